"""A settled request, read back from its `RequestSettled` events: the one its
key names and, when its hold had closed before the end, the rest charged after."""
from __future__ import annotations

from typing import NamedTuple

import orjson
from sqlalchemy import Connection, select

from ledger.holds import settlement_key
from ledger.money import nano_usd_to_usd_text
from ledger.schema import ledger_events


def rest_key(key: str) -> str:
    """The key of what was charged after the request's hold had closed (proxy/settlement.py)."""
    return f"{key}:rest"


class Settled(NamedTuple):
    charge_nano_usd: int
    prompt_tokens: int
    completion_tokens: int


def withheld_key(request_id: str, seq: int) -> str:
    """The key of the reversal of settlement `seq`, whose answer was withheld (proxy/settlement.py)."""
    return f"withheld:{request_id}:{seq}"


def settlement_seqs(conn: Connection, request_id: str) -> list[int]:
    """The events that charged this request, oldest first."""
    return [row.seq for row in _settlements(conn, request_id)]


def _settlements(conn: Connection, request_id: str) -> list:
    key = settlement_key(request_id)
    return conn.execute(
        select(ledger_events.c.seq, ledger_events.c.payload, ledger_events.c.recorded_at)
        .where(ledger_events.c.idempotency_key.in_((key, rest_key(key)))).order_by(ledger_events.c.seq)
    ).all()


def _reversed(conn: Connection, seqs: list[int]) -> set[int]:
    """Which of these events a later `EventReversed` undid."""
    rows = conn.execute(select(ledger_events.c.reverses_seq).where(ledger_events.c.reverses_seq.in_(seqs)))
    return {row.reverses_seq for row in rows}


def first_settlement(conn: Connection, request_id: str) -> Settled | None:
    """What the settlement under the request's own key charged (the sweeper's, at the usage last recorded)."""
    row = conn.execute(select(ledger_events.c.payload).where(ledger_events.c.idempotency_key == settlement_key(request_id))).first()
    if row is None:
        return None
    event = orjson.loads(row.payload)
    return Settled(event["charge_nano_usd"], event["meta"].get("prompt_tokens", 0), event["meta"].get("completion_tokens", 0))


# What the GPU's side earned and which GPU it was are the owner's business: a
# customer's export shows neither (invoices/exports.py), nor does this.
HIDDEN_FROM_CUSTOMERS = frozenset({"owner_nano_usd", "worker_id", "customer_account_id"})


def find_generation(conn: Connection, request_id: str, account_id: int) -> dict | None:
    """The recorded charge of a request of this account, as its customer sees it; None for anyone else's."""
    record = generation_record(conn, request_id)
    if record is None or record["customer_account_id"] != account_id:
        return None
    return {name: value for name, value in record.items() if name not in HIDDEN_FROM_CUSTOMERS}


def generation_record(conn: Connection, request_id: str) -> dict | None:
    """Everything recorded of a settled request, the owner's share and the worker included."""
    rows = _settlements(conn, request_id)
    if not rows:
        return None
    events = [orjson.loads(row.payload) for row in rows]
    reversed_seqs = _reversed(conn, [row.seq for row in rows])
    kept = [e for row, e in zip(rows, events) if row.seq not in reversed_seqs]  # a reversed charge costs nothing
    meta, charge = events[0]["meta"], sum(e["charge_nano_usd"] for e in kept)
    return {
        "id": request_id,
        "object": "generation",
        "cost_nano_usd": charge,
        "cost": nano_usd_to_usd_text(charge),
        "owner_nano_usd": sum(e["owner_nano_usd"] for e in kept),
        "reversed": bool(reversed_seqs),
        "prompt_tokens": sum(e["meta"].get("prompt_tokens", 0) for e in events),
        "completion_tokens": sum(e["meta"].get("completion_tokens", 0) for e in events),
        "model": meta.get("model"),
        "worker_id": meta.get("worker_id"),
        "customer_account_id": events[0]["customer_account_id"],
        "api_key_id": meta.get("api_key_id"),
        "started_at": meta.get("started_at"),
        "completed_at": rows[-1].recorded_at.isoformat(),
        "ledger_seq": rows[-1].seq,
    }
