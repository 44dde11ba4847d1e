"""A settled request, read back from its `RequestSettled` event."""
from __future__ import annotations

import orjson
from sqlalchemy import Connection, select

from ledger.money import nano_usd_to_usd_text
from ledger.schema import ledger_events


def settlement_key(request_id: str) -> str:
    return f"settle:{request_id}"


def find_generation(conn: Connection, request_id: str, account_id: int) -> dict | None:
    """The recorded charge of a request of this account; None for anyone else's."""
    row = conn.execute(
        select(ledger_events.c.seq, ledger_events.c.payload, ledger_events.c.recorded_at)
        .where(ledger_events.c.idempotency_key == settlement_key(request_id))
    ).first()
    if row is None:
        return None
    event = orjson.loads(row.payload)
    if event["customer_account_id"] != account_id:
        return None
    meta = event["meta"]
    return {
        "id": request_id,
        "object": "generation",
        "cost_nano_usd": event["charge_nano_usd"],
        "cost": nano_usd_to_usd_text(event["charge_nano_usd"]),
        "owner_nano_usd": event["owner_nano_usd"],
        "prompt_tokens": meta.get("prompt_tokens"),
        "completion_tokens": meta.get("completion_tokens"),
        "model": meta.get("model"),
        "worker_id": meta.get("worker_id"),
        "api_key_id": meta.get("api_key_id"),
        "started_at": meta.get("started_at"),
        "completed_at": row.recorded_at.isoformat(),
        "ledger_seq": row.seq,
    }
