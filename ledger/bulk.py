"""Set-based writes for a whole batch: one statement per table.

On PostgreSQL each statement takes its rows as arrays (`unnest`), so a batch of
a thousand settlements is a handful of statements, not thousands. SQLite, the
embedded default, takes the same rows through executemany.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Callable

from sqlalchemy import Connection, String, any_, bindparam, cast, delete, update
from sqlalchemy.dialects.postgresql import ARRAY

from ledger.db import is_postgres
from ledger.schema import (
    account_balances,
    customer_holds,
    holds,
    ledger_events,
    ledger_head,
    ledger_postings,
    spend_limit_holds,
    spend_limit_usage,
)


# PostgreSQL array literals, built at C speed: psycopg adapts a list element by
# element in Python, which was the largest single cost of a batch.
def ints(values) -> str:
    return "{" + ",".join(map(str, values)) + "}"


def nullable_ints(values) -> str:
    return "{" + ",".join(["NULL" if v is None else str(v) for v in values]) + "}"


def words(values) -> str:
    """Strings that need no quoting: event type names."""
    return "{" + ",".join(values) + "}"


def bytea_array(values) -> str:
    """bytea elements in hex form; the backslash is doubled for the array parser."""
    return "{" + ",".join(['"\\\\x' + v.hex() + '"' for v in values]) + "}"


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def texts(values) -> str:
    return "{" + ",".join(map(_quoted, values)) + "}"


def nullable_texts(values) -> str:
    return "{" + ",".join(["NULL" if v is None else _quoted(v) for v in values]) + "}"


Spec = tuple[tuple[str, Callable], ...]
EVENT_SPEC: Spec = (
    ("seq", ints), ("event_type", words), ("payload", texts), ("idempotency_key", texts),
    ("content_digest", bytea_array), ("reverses_seq", nullable_ints), ("prev_hash", bytea_array), ("hash", bytea_array),
)
POSTING_SPEC: Spec = (("event_seq", ints), ("leg", ints), ("account_id", ints), ("amount_nano_usd", ints))
HOLD_SPEC: Spec = (
    ("account_id", ints), ("amount_nano_usd", ints), ("idempotency_key", texts), ("ttl_s", ints),
    ("spend_limit_id", nullable_ints),
)
HOLD_ROW = ("id", "account_id", "amount_nano_usd", "idempotency_key", "created_at", "expires_at", "spend_limit_id",
            "capture_nano_usd", "capture_owner_account_id", "capture_request_id", "capture_meta")
HOLD_ROW_SPEND_LIMIT = HOLD_ROW.index("spend_limit_id")


def _columns(spec: Spec, rows: list[tuple]) -> dict[str, str]:
    columns = list(zip(*rows)) or [()] * len(spec)  # no rows: every array empty
    return {name: encode(column) for (name, encode), column in zip(spec, columns)}


def _dicts(spec: Spec, rows: list[tuple]) -> list[dict]:
    names = [name for name, _ in spec]
    return [dict(zip(names, row)) for row in rows]


_PG_INSERT_EVENTS = """
INSERT INTO ledger_events (seq, event_type, payload, idempotency_key, content_digest, reverses_seq, prev_hash, hash, recorded_at)
SELECT u.*, %(recorded_at)s FROM unnest(%(seq)s::bigint[], %(event_type)s::text[], %(payload)s::text[],
    %(idempotency_key)s::text[], %(content_digest)s::bytea[], %(reverses_seq)s::bigint[], %(prev_hash)s::bytea[], %(hash)s::bytea[]) AS u
"""
_PG_INSERT_POSTINGS = """
INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd)
SELECT * FROM unnest(%(event_seq)s::bigint[], %(leg)s::int[], %(account_id)s::bigint[], %(amount_nano_usd)s::bigint[])
"""
# holds_closed_nano_usd is added to, not set: releases change it without the append lock.
_PG_SET_BALANCES = """
UPDATE account_balances AS b
SET balance_nano_usd = u.balance, last_event_seq = %(seq)s, holds_closed_nano_usd = b.holds_closed_nano_usd + u.closed
FROM unnest(%(account_id)s::bigint[], %(balance)s::bigint[], %(closed)s::bigint[]) AS u(account_id, balance, closed)
WHERE b.account_id = u.account_id
"""
_PG_ADD_CLOSED = """
UPDATE account_balances AS b SET holds_closed_nano_usd = b.holds_closed_nano_usd + u.closed
FROM unnest(%(account_id)s::bigint[], %(closed)s::bigint[]) AS u(account_id, closed)
WHERE b.account_id = u.account_id
"""
_PG_ADD_PLACED = """
UPDATE customer_holds AS c SET holds_placed_nano_usd = c.holds_placed_nano_usd + u.placed
FROM unnest(%(account_id)s::bigint[], %(placed)s::bigint[]) AS u(account_id, placed)
WHERE c.account_id = u.account_id
"""
_PG_CLOSE_HOLDS = f"""
DELETE FROM holds WHERE id = ANY(%(id)s::bigint[])
RETURNING {", ".join(HOLD_ROW)}
"""
_PG_INSERT_HOLDS = """
INSERT INTO holds (account_id, amount_nano_usd, idempotency_key, created_at, expires_at, spend_limit_id)
SELECT u.account_id, u.amount, u.key, %(now)s, %(now)s + make_interval(secs => u.ttl_s), u.spend_limit_id
FROM unnest(%(account_id)s::bigint[], %(amount_nano_usd)s::bigint[], %(idempotency_key)s::text[],
    %(ttl_s)s::int[], %(spend_limit_id)s::bigint[]) AS u(account_id, amount, key, ttl_s, spend_limit_id)
RETURNING id, idempotency_key
"""


# Everything an append writes once its events are decided, as one statement on
# PostgreSQL (data-modifying CTEs): one round trip instead of four.
_PG_WRITE_APPENDED_TEMPLATE = """
WITH events AS (
    INSERT INTO ledger_events (seq, event_type, payload, idempotency_key, content_digest, reverses_seq, prev_hash, hash, recorded_at)
    SELECT u.*, %(recorded_at)s FROM unnest(%(seq)s::bigint[], %(event_type)s::text[], %(payload)s::text[],
        %(idempotency_key)s::text[], %(content_digest)s::bytea[], %(reverses_seq)s::bigint[], %(prev_hash)s::bytea[], %(hash)s::bytea[]) AS u
), postings AS (
    INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd)
    SELECT * FROM unnest(%(event_seq)s::bigint[], %(leg)s::int[], %(account_id)s::bigint[], %(amount_nano_usd)s::bigint[])
), balances AS (
    UPDATE account_balances AS b
    SET balance_nano_usd = u.balance, last_event_seq = %(last_seq)s, holds_closed_nano_usd = b.holds_closed_nano_usd + u.closed
    FROM unnest(%(balance_account_id)s::bigint[], %(balance)s::bigint[], %(closed)s::bigint[]) AS u(account_id, balance, closed)
    WHERE b.account_id = u.account_id
){limits}
UPDATE ledger_head SET last_seq = %(last_seq)s, last_hash = %(last_hash)s WHERE id = 1
"""
_PG_WRITE_APPENDED = _PG_WRITE_APPENDED_TEMPLATE.format(limits="")
# The same, when the batch settled holds that reserve against spend limits.
_PG_WRITE_APPENDED_WITH_LIMITS = _PG_WRITE_APPENDED_TEMPLATE.format(limits=""", limits AS (
    UPDATE spend_limit_usage AS l
    SET spent_nano_usd = l.spent_nano_usd + u.spent, holds_closed_nano_usd = l.holds_closed_nano_usd + u.closed
    FROM unnest(%(limit_id)s::bigint[], %(limit_spent)s::bigint[], %(limit_closed)s::bigint[]) AS u(limit_id, spent, closed)
    WHERE l.limit_id = u.limit_id
)""")


def write_appended(conn: Connection, event_rows: list[tuple], posting_rows: list[tuple], balances: dict[int, int],
                   holds_closed: dict[int, int], last_seq: int, last_hash: bytes, recorded_at: datetime,
                   limit_usage: dict[int, tuple[int, int]]) -> None:
    """Events, postings, balances, spend limits (limit id -> (spent, hold amount
    closed)) and the head of the chain, for a decided batch."""
    if not is_postgres(conn):
        insert_events(conn, event_rows, recorded_at)
        insert_postings(conn, posting_rows)
        set_balances(conn, balances, holds_closed, last_seq)
        add_limit_usage(conn, limit_usage)
        conn.execute(update(ledger_head).where(ledger_head.c.id == 1).values(last_seq=last_seq, last_hash=last_hash))
        return
    ids, limit_ids = sorted(balances), sorted(limit_usage)
    conn.exec_driver_sql(_PG_WRITE_APPENDED_WITH_LIMITS if limit_ids else _PG_WRITE_APPENDED, {
        **_columns(EVENT_SPEC, event_rows), **_columns(POSTING_SPEC, posting_rows),
        "recorded_at": recorded_at, "last_seq": last_seq, "last_hash": last_hash,
        "balance_account_id": ints(ids), "balance": ints([balances[a] for a in ids]),
        "closed": ints([holds_closed.get(a, 0) for a in ids]),
        "limit_id": ints(limit_ids), "limit_spent": ints([limit_usage[i][0] for i in limit_ids]),
        "limit_closed": ints([limit_usage[i][1] for i in limit_ids]),
    })


IN_CLAUSE_SIZE_MAX = 1000


def in_chunks(values: list, size: int = IN_CLAUSE_SIZE_MAX):
    for start in range(0, len(values), size):
        yield values[start : start + size]


def pg_rows(conn: Connection, sql: str, params: dict) -> list[tuple]:
    """Run on the transaction's own psycopg connection and return plain tuples:
    for statements returning a row per batch item, SQLAlchemy's per-row result
    processing costs more than the statement."""
    with conn.connection.driver_connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def pipelined_rows(conn: Connection, statements: list[tuple[str, dict]]) -> list[list[tuple]]:
    """Several statements in one round trip (psycopg's pipeline mode), run in
    order on the server, each reading after the one before it took effect."""
    raw = conn.connection.driver_connection
    cursors = []
    try:
        with raw.pipeline():
            for sql, params in statements:
                cursor = raw.cursor()
                cursors.append(cursor)
                cursor.execute(sql, params)
        return [cursor.fetchall() for cursor in cursors]
    finally:
        for cursor in cursors:
            cursor.close()


def one_of(conn: Connection, column, values: list):
    """`column IN values`; on PostgreSQL one array parameter (`= ANY`), so the
    statement text, and every cache keyed on it, is the same for any batch size."""
    if not is_postgres(conn):
        return column.in_(values)
    literal = texts(values) if values and isinstance(values[0], str) else ints(values)
    return column == any_(cast(bindparam(None, literal, type_=String), ARRAY(column.type)))


def insert_events(conn: Connection, rows: list[tuple], recorded_at: datetime) -> None:
    if is_postgres(conn):
        conn.exec_driver_sql(_PG_INSERT_EVENTS, {**_columns(EVENT_SPEC, rows), "recorded_at": recorded_at})
    else:
        conn.execute(ledger_events.insert(), [{**d, "recorded_at": recorded_at} for d in _dicts(EVENT_SPEC, rows)])


def insert_postings(conn: Connection, rows: list[tuple]) -> None:
    if not rows:
        return
    if is_postgres(conn):
        conn.exec_driver_sql(_PG_INSERT_POSTINGS, _columns(POSTING_SPEC, rows))
    else:
        conn.execute(ledger_postings.insert(), _dicts(POSTING_SPEC, rows))


_SET_BALANCE = (
    update(account_balances)
    .where(account_balances.c.account_id == bindparam("b_account_id"))
    .values(
        balance_nano_usd=bindparam("b_balance"),
        last_event_seq=bindparam("b_seq"),
        holds_closed_nano_usd=account_balances.c.holds_closed_nano_usd + bindparam("b_closed"),
    )
)
_ADD_CLOSED = (
    update(account_balances)
    .where(account_balances.c.account_id == bindparam("b_account_id"))
    .values(holds_closed_nano_usd=account_balances.c.holds_closed_nano_usd + bindparam("b_closed"))
)
_ADD_PLACED = (
    update(customer_holds)
    .where(customer_holds.c.account_id == bindparam("b_account_id"))
    .values(holds_placed_nano_usd=customer_holds.c.holds_placed_nano_usd + bindparam("b_placed"))
)


def set_balances(conn: Connection, balances: dict[int, int], holds_closed: dict[int, int], last_seq: int) -> None:
    """Balances as decided under the append lock; `holds_closed` adds the full
    amount of every hold the batch settled."""
    if not balances:  # a batch of events that move no money
        return
    ids = sorted(balances)
    closed = [holds_closed.get(a, 0) for a in ids]
    if is_postgres(conn):
        conn.exec_driver_sql(
            _PG_SET_BALANCES,
            {"account_id": ints(ids), "balance": ints([balances[a] for a in ids]), "closed": ints(closed), "seq": last_seq},
        )
    else:
        conn.execute(_SET_BALANCE, [{"b_account_id": a, "b_balance": balances[a], "b_seq": last_seq, "b_closed": c} for a, c in zip(ids, closed)])


def add_holds_closed(conn: Connection, closed: dict[int, int]) -> None:
    """Released or expired holds stop counting against their customers."""
    _add(conn, _PG_ADD_CLOSED, _ADD_CLOSED, "closed", closed)


def add_holds_placed(conn: Connection, placed: dict[int, int]) -> None:
    _add(conn, _PG_ADD_PLACED, _ADD_PLACED, "placed", placed)


def _add(conn: Connection, pg_sql: str, statement, name: str, amounts: dict[int, int]) -> None:
    if not amounts:
        return
    ids = sorted(amounts)
    if is_postgres(conn):
        conn.exec_driver_sql(pg_sql, {"account_id": ints(ids), name: ints([amounts[a] for a in ids])})
    else:
        conn.execute(statement, [{"b_account_id": a, f"b_{name}": amounts[a]} for a in ids])


_CLOSE_HOLD = delete(holds).where(holds.c.id == bindparam("b_id")).returning(*(holds.c[name] for name in HOLD_ROW))


def close_holds(conn: Connection, hold_ids: list[int]) -> list[tuple]:
    """Delete these holds; returns each one that existed as a HOLD_ROW tuple."""
    if not hold_ids:
        return []
    if is_postgres(conn):
        return pg_rows(conn, _PG_CLOSE_HOLDS, {"id": ints(hold_ids)})
    closed = []
    for hold_id in hold_ids:  # SQLite: executemany cannot return rows
        closed.extend(tuple(r) for r in conn.execute(_CLOSE_HOLD, {"b_id": hold_id}))
    return closed


def reopen_holds(conn: Connection, rows: list[tuple]) -> None:
    """Put back holds closed for settlements that then failed under the append lock (rare)."""
    if rows:
        conn.execute(holds.insert(), [dict(zip(HOLD_ROW, row)) for row in rows])


def insert_holds(conn: Connection, rows: list[tuple], now: datetime) -> dict[str, int]:
    """rows: HOLD_SPEC tuples; returns hold id by idempotency key."""
    if not rows:
        return {}
    if is_postgres(conn):
        return {key: hold_id for hold_id, key in pg_rows(conn, _PG_INSERT_HOLDS, {**_columns(HOLD_SPEC, rows), "now": now})}
    values = [
        {"account_id": a, "amount_nano_usd": m, "idempotency_key": k,
         "created_at": now, "expires_at": now + timedelta(seconds=ttl), "spend_limit_id": limit_id}
        for a, m, k, ttl, limit_id in rows
    ]
    inserted = conn.execute(holds.insert().returning(holds.c.id, holds.c.idempotency_key, sort_by_parameter_order=True), values)
    return {key: hold_id for hold_id, key in inserted}


# Spend limits (ledger/spend_limits.py): what holds reserved, and what settlements spent.
_PG_ADD_LIMIT_PLACED = """
UPDATE spend_limit_holds AS l SET holds_placed_nano_usd = l.holds_placed_nano_usd + u.placed
FROM unnest(%(limit_id)s::bigint[], %(placed)s::bigint[]) AS u(limit_id, placed) WHERE l.limit_id = u.limit_id
"""
_PG_ADD_LIMIT_USAGE = """
UPDATE spend_limit_usage AS l
SET spent_nano_usd = l.spent_nano_usd + u.spent, holds_closed_nano_usd = l.holds_closed_nano_usd + u.closed
FROM unnest(%(limit_id)s::bigint[], %(spent)s::bigint[], %(closed)s::bigint[]) AS u(limit_id, spent, closed)
WHERE l.limit_id = u.limit_id
"""
_ADD_LIMIT_PLACED = (
    update(spend_limit_holds).where(spend_limit_holds.c.limit_id == bindparam("b_limit_id"))
    .values(holds_placed_nano_usd=spend_limit_holds.c.holds_placed_nano_usd + bindparam("b_placed"))
)
_ADD_LIMIT_USAGE = (
    update(spend_limit_usage).where(spend_limit_usage.c.limit_id == bindparam("b_limit_id"))
    .values(spent_nano_usd=spend_limit_usage.c.spent_nano_usd + bindparam("b_spent"),
            holds_closed_nano_usd=spend_limit_usage.c.holds_closed_nano_usd + bindparam("b_closed"))
)


def add_limit_placed(conn: Connection, placed: dict[int, int]) -> None:
    if not placed:
        return
    ids = sorted(placed)
    if is_postgres(conn):
        conn.exec_driver_sql(_PG_ADD_LIMIT_PLACED, {"limit_id": ints(ids), "placed": ints([placed[i] for i in ids])})
    else:
        conn.execute(_ADD_LIMIT_PLACED, [{"b_limit_id": i, "b_placed": placed[i]} for i in ids])


def add_limit_usage(conn: Connection, usage: dict[int, tuple[int, int]]) -> None:
    """usage: limit id -> (spent by settlements, hold amounts closed)."""
    if not usage:
        return
    ids = sorted(usage)
    if is_postgres(conn):
        conn.exec_driver_sql(_PG_ADD_LIMIT_USAGE, {"limit_id": ints(ids), "spent": ints([usage[i][0] for i in ids]),
                                             "closed": ints([usage[i][1] for i in ids])})
    else:
        conn.execute(_ADD_LIMIT_USAGE, [{"b_limit_id": i, "b_spent": usage[i][0], "b_closed": usage[i][1]} for i in ids])


def add_limit_closed(conn: Connection, closed: dict[int, int]) -> None:
    """Released or expired holds stop counting against their limits."""
    add_limit_usage(conn, {i: (0, amount) for i, amount in closed.items()})
