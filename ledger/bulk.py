"""Set-based writes for a whole batch: one statement per table.

On PostgreSQL each statement takes its rows as arrays (`unnest`), so a batch of
a thousand settlements is a handful of statements, not thousands. SQLite, the
embedded default, takes the same rows through executemany.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Connection, any_, bindparam, update
from sqlalchemy.dialects.postgresql import ARRAY

from ledger.db import is_postgres
from ledger.schema import account_balances, holds, ledger_events, ledger_postings

EVENT_COLUMNS = ("seq", "event_type", "payload", "idempotency_key", "content_digest", "reverses_seq", "prev_hash", "hash")
POSTING_COLUMNS = ("event_seq", "leg", "account_id", "amount_nano_usd")
HOLD_COLUMNS = ("account_id", "amount_nano_usd", "idempotency_key", "content_digest", "ttl_s")

_PG_INSERT_EVENTS = """
INSERT INTO ledger_events (seq, event_type, payload, idempotency_key, content_digest, reverses_seq, prev_hash, hash, recorded_at)
SELECT u.*, %(recorded_at)s FROM unnest(%(seq)b::bigint[], %(event_type)b::text[], %(payload)b::text[],
    %(idempotency_key)b::text[], %(content_digest)b::text[], %(reverses_seq)b::bigint[], %(prev_hash)b::text[], %(hash)b::text[]) AS u
"""
_PG_INSERT_POSTINGS = """
INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd)
SELECT * FROM unnest(%(event_seq)b::bigint[], %(leg)b::int[], %(account_id)b::bigint[], %(amount_nano_usd)b::bigint[])
"""
_PG_SET_BALANCES = """
UPDATE account_balances AS b SET balance_nano_usd = u.balance, last_event_seq = %(seq)s
FROM unnest(%(account_id)b::bigint[], %(balance)b::bigint[]) AS u(account_id, balance)
WHERE b.account_id = u.account_id
"""
_PG_CLOSE_HOLDS = """
UPDATE holds AS h SET state = 'settled', captured_nano_usd = u.captured, settled_by_key = u.key, closed_at = %(closed_at)s
FROM unnest(%(id)b::bigint[], %(captured)b::bigint[], %(key)b::text[]) AS u(id, captured, key)
WHERE h.id = u.id
"""
_PG_INSERT_HOLDS = """
INSERT INTO holds (account_id, amount_nano_usd, state, idempotency_key, content_digest, created_at, expires_at)
SELECT u.account_id, u.amount, 'active', u.key, u.digest, %(now)s, %(now)s + make_interval(secs => u.ttl_s)
FROM unnest(%(account_id)b::bigint[], %(amount_nano_usd)b::bigint[], %(idempotency_key)b::text[],
    %(content_digest)b::text[], %(ttl_s)b::int[]) AS u(account_id, amount, key, digest, ttl_s)
RETURNING id, idempotency_key
"""


def one_of(conn: Connection, column, values: list):
    """`column IN values`; on PostgreSQL one array parameter (`= ANY`), so the
    statement text, and every cache keyed on it, is the same for any batch size."""
    if is_postgres(conn):
        return column == any_(bindparam(None, list(values), type_=ARRAY(column.type)))
    return column.in_(values)


def _columns(names: tuple[str, ...], rows: list[tuple]) -> dict[str, list]:
    return dict(zip(names, (list(column) for column in zip(*rows))))


def _dicts(names: tuple[str, ...], rows: list[tuple]) -> list[dict]:
    return [dict(zip(names, row)) for row in rows]


def insert_events(conn: Connection, rows: list[tuple], recorded_at: datetime) -> None:
    if is_postgres(conn):
        conn.exec_driver_sql(_PG_INSERT_EVENTS, {**_columns(EVENT_COLUMNS, rows), "recorded_at": recorded_at})
    else:
        conn.execute(ledger_events.insert(), [{**d, "recorded_at": recorded_at} for d in _dicts(EVENT_COLUMNS, rows)])


def insert_postings(conn: Connection, rows: list[tuple]) -> None:
    if not rows:
        return
    if is_postgres(conn):
        conn.exec_driver_sql(_PG_INSERT_POSTINGS, _columns(POSTING_COLUMNS, rows))
    else:
        conn.execute(ledger_postings.insert(), _dicts(POSTING_COLUMNS, rows))


_SET_BALANCE = (
    update(account_balances)
    .where(account_balances.c.account_id == bindparam("b_account_id"))
    .values(balance_nano_usd=bindparam("b_balance"), last_event_seq=bindparam("b_seq"))
)


def set_balances(conn: Connection, balances: dict[int, int], last_seq: int) -> None:
    account_ids = sorted(balances)
    if is_postgres(conn):
        conn.exec_driver_sql(_PG_SET_BALANCES, {"account_id": account_ids, "balance": [balances[a] for a in account_ids], "seq": last_seq})
    else:
        conn.execute(_SET_BALANCE, [{"b_account_id": a, "b_balance": balances[a], "b_seq": last_seq} for a in account_ids])


_CLOSE_HOLD = (
    update(holds)
    .where(holds.c.id == bindparam("b_id"))
    .values(state="settled", captured_nano_usd=bindparam("b_captured"), settled_by_key=bindparam("b_key"), closed_at=bindparam("b_closed_at"))
)
_REOPEN_HOLD = (
    update(holds)
    .where(holds.c.id == bindparam("b_id"))
    .values(state="active", captured_nano_usd=None, settled_by_key=None, closed_at=None)
)


def close_settled_holds(conn: Connection, rows: list[tuple[int, int, str]], closed_at: datetime) -> None:
    """rows: (hold id, captured nano-USD, idempotency key of the settlement)."""
    if not rows:
        return
    if is_postgres(conn):
        conn.exec_driver_sql(_PG_CLOSE_HOLDS, {**_columns(("id", "captured", "key"), rows), "closed_at": closed_at})
    else:
        conn.execute(_CLOSE_HOLD, [{"b_id": h, "b_captured": c, "b_key": k, "b_closed_at": closed_at} for h, c, k in rows])


def reopen_holds(conn: Connection, hold_ids: list[int]) -> None:
    """Undo `close_settled_holds` for settlements that failed under the append lock (rare)."""
    if hold_ids:
        conn.execute(_REOPEN_HOLD, [{"b_id": h} for h in hold_ids])


def insert_holds(conn: Connection, rows: list[tuple], now: datetime) -> dict[str, int]:
    """rows: HOLD_COLUMNS tuples; returns hold id by idempotency key."""
    if not rows:
        return {}
    if is_postgres(conn):
        return dict((key, hold_id) for hold_id, key in conn.exec_driver_sql(_PG_INSERT_HOLDS, {**_columns(HOLD_COLUMNS, rows), "now": now}))
    values = [
        {"account_id": a, "amount_nano_usd": m, "state": "active", "idempotency_key": k, "content_digest": d,
         "created_at": now, "expires_at": now + timedelta(seconds=ttl)}
        for a, m, k, d, ttl in rows
    ]
    inserted = conn.execute(holds.insert().returning(holds.c.id, holds.c.idempotency_key, sort_by_parameter_order=True), values)
    return {key: hold_id for hold_id, key in inserted}
