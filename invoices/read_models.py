"""Usage and earnings per day, as consumers of the ledger log.

Each page of events and the consumer's position are written in one
transaction (`ledger.log.consume_once`), so every settlement counts exactly
once, and a rebuild from the first event gives the same tables."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import orjson
from sqlalchemy import Connection, Engine, delete, func, select, update

from invoices.schema import earnings_daily, usage_daily
from ledger import log
from ledger.log import StoredEvent, consumer_position
from ledger.schema import consumer_positions, ledger_events

CONSUMER = "read_models.usage_earnings"
PAGES_PER_RUN_MAX = 100

USAGE_KEY = ("account_id", "api_key_id", "model", "day")
USAGE_SUMS = ("requests", "prompt_tokens", "completion_tokens", "cost_nano_usd")
EARNINGS_KEY = ("owner_account_id", "worker_id", "model", "day")
EARNINGS_SUMS = ("requests", "earnings_nano_usd")


def _settlement(conn: Connection, event: StoredEvent) -> tuple[dict, int] | None:
    """(RequestSettled payload, +1 or -1) for a settlement or the reversal of one."""
    if event.event_type == "RequestSettled":
        return orjson.loads(event.payload_json), 1
    if event.event_type == "EventReversed":
        reversed_seq = orjson.loads(event.payload_json)["reversed_seq"]
        row = conn.execute(select(ledger_events.c.event_type, ledger_events.c.payload, ledger_events.c.recorded_at)
                           .where(ledger_events.c.seq == reversed_seq)).one()
        if row.event_type == "RequestSettled":
            return orjson.loads(row.payload), -1
    return None


def apply_page(conn: Connection, events: list[StoredEvent]) -> None:
    usage: dict[tuple, list[int]] = defaultdict(lambda: [0] * len(USAGE_SUMS))
    earnings: dict[tuple, list[int]] = defaultdict(lambda: [0] * len(EARNINGS_SUMS))
    for event in events:
        found = _settlement(conn, event)
        if found is None:
            continue
        payload, sign = found
        meta, day = payload["meta"], event.recorded_at.date().isoformat()
        model = str(meta.get("model", ""))
        u = usage[(payload["customer_account_id"], int(meta.get("api_key_id") or 0), model, day)]
        for i, value in enumerate((1, meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0), payload["charge_nano_usd"])):
            u[i] += sign * int(value)
        e = earnings[(payload["owner_account_id"], int(meta.get("worker_id") or 0), model, day)]
        e[0] += sign
        e[1] += sign * payload["owner_nano_usd"]
    _add(conn, usage_daily, USAGE_KEY, USAGE_SUMS, usage)
    _add(conn, earnings_daily, EARNINGS_KEY, EARNINGS_SUMS, earnings)


def _add(conn: Connection, table, key_names: tuple, sum_names: tuple, deltas: dict) -> None:
    for key, values in sorted(deltas.items()):
        where = [table.c[name] == value for name, value in zip(key_names, key)]
        changed = conn.execute(update(table).where(*where).values(
            {name: table.c[name] + value for name, value in zip(sum_names, values)})).rowcount
        if not changed:
            conn.execute(table.insert().values(**dict(zip(key_names, key)), **dict(zip(sum_names, values))))


def catch_up(engine: Engine, progress: Callable[[int], None] | None = None) -> int:
    """Apply what the log holds beyond the position (bounded per run); returns events read."""
    return log.catch_up(engine, CONSUMER, apply_page, pages_max=PAGES_PER_RUN_MAX, with_postings=False, progress=progress)


def rebuild(engine: Engine, progress: Callable[[int], None] | None = None) -> int:
    """From the first event: empty the tables and the position together, then catch up to the end."""
    with engine.begin() as conn:
        conn.execute(delete(usage_daily))
        conn.execute(delete(earnings_daily))
        conn.execute(delete(consumer_positions).where(consumer_positions.c.consumer == CONSUMER))
    total = 0
    while read := catch_up(engine, progress):
        total += read
    return total


def lag_events(engine: Engine) -> int:
    """How many events the read models have not applied yet."""
    with engine.connect() as conn:
        head = conn.execute(select(func.coalesce(func.max(ledger_events.c.seq), 0))).scalar_one()
        return head - consumer_position(conn, CONSUMER)
