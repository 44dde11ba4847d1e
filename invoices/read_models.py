"""Usage and earnings per day, postings by account (each one, and their sums
per day), and every settled request (`generations`), as one consumer of the
ledger log.

Each page of events and the consumer's position are written in one
transaction (`ledger.log.consume_once`), so every settlement counts exactly
once, and a rebuild from the first event gives the same tables.

One applier follows the log at a time (`ApplierLease`): the others skip
rather than queue on the position's row lock. The lease only decides who
works; exactly once never depends on it."""
from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable

import orjson
from sqlalchemy import Connection, Engine, Integer, delete, func, select, text
from sqlalchemy.dialects import sqlite

from invoices.limits import PAGES_PER_RUN_MAX, READ_MODELS_APPLIER_LOCK_KEY, REFERENCE_CHARS_MAX
from invoices.schema import account_postings, earnings_daily, generations, postings_daily, usage_daily
from ledger import log
from ledger.db import is_postgres
from ledger.log import StoredEvent, consumer_position
from ledger.schema import UTCDateTime, consumer_positions, ledger_events, utc_now
from ledger.storage import pg_arrays

CONSUMER = "read_models.usage_earnings"
logger = logging.getLogger(__name__)
POSTING_COLUMNS = ("account_id", "event_seq", "leg", "recorded_at", "event_type", "source_type", "amount_nano_usd",
                   "model", "api_key_id", "worker_id", "reference")

USAGE_KEY = ("account_id", "api_key_id", "model", "day")
USAGE_SUMS = ("requests", "prompt_tokens", "completion_tokens", "cost_nano_usd")
EARNINGS_KEY = ("owner_account_id", "worker_id", "model", "day")
EARNINGS_SUMS = ("requests", "earnings_nano_usd")
POSTINGS_DAILY_KEY = ("account_id", "day", "source_type")
POSTINGS_DAILY_SUMS = ("postings", "amount_nano_usd")
# A request's row: described once, by its first settlement; its sums move with
# every settlement (the rest charged after its hold closed) and reversal.
GENERATION_KEY = ("request_id",)
GENERATION_FIRST = ("account_id", "api_key_id", "model", "worker_id", "ttft_ms", "status", "completed_at")
GENERATION_SUMS = ("prompt_tokens", "completion_tokens", "cost_nano_usd", "owner_nano_usd")
# The statuses of a settled request. The proxy's settlement metadata says how
# its stream ended ("outcome": completed, cancelled, failed_mid_stream) and
# whether the caller streamed ("stream"); settlements from before it said
# neither, and are complete answers.
STREAMED, COMPLETED, CANCELLED = "streamed", "completed", "cancelled"
OUTCOME_COMPLETED = "completed"


def generation_status(meta: dict) -> str:
    """Finished, streamed or not; or cut short (the caller left, its hold was
    taken, its worker failed after the first token), billed for what was relayed."""
    if meta.get("outcome", OUTCOME_COMPLETED) != OUTCOME_COMPLETED:
        return CANCELLED
    return STREAMED if meta.get("stream") is True else COMPLETED


def _reversed_events(conn: Connection, events: list[StoredEvent]) -> dict[int, tuple[str, dict]]:
    """The events this page reverses: seq -> (type, payload), in one query."""
    seqs = [orjson.loads(e.payload_json)["reversed_seq"] for e in events if e.event_type == "EventReversed"]
    if not seqs:
        return {}
    rows = conn.execute(select(ledger_events.c.seq, ledger_events.c.event_type, ledger_events.c.payload)
                        .where(ledger_events.c.seq.in_(seqs)))
    return {r.seq: (r.event_type, orjson.loads(r.payload)) for r in rows}


def _reference(source_type: str, source: dict) -> str:
    if source_type == "RequestSettled":
        return source["request_id"]
    if "payout_id" in source:  # a payout's steps: which payout, on which rail, and why it came back
        reason = f": {source['reason']}" if "reason" in source else ""
        return f"payout {source['payout_id']} ({source['rail']}){reason}"
    if "external_reference" in source:
        method = source.get("payment_method")
        return f"{method}: {source['external_reference']}" if method else source["external_reference"]
    return str(source.get("reason", ""))


def _count_settlement(usage: dict, earnings: dict, settled: dict, labels: tuple[str, int, int], day: str, sign: int) -> None:
    """A settlement (+1) or its reversal (-1) in the day's usage and earnings sums."""
    model, key_id, worker_id = labels
    meta = settled["meta"]
    u = usage[(settled["customer_account_id"], key_id, model, day)]
    for i, value in enumerate((1, meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0), settled["charge_nano_usd"])):
        u[i] += sign * int(value)
    e = earnings[(settled["owner_account_id"], worker_id, model, day)]
    e[0] += sign
    e[1] += sign * settled["owner_nano_usd"]


def _count_generation(requests: dict, event: StoredEvent, settled: dict, labels: tuple[str, int, int], sign: int) -> None:
    """A settlement (+1) or its reversal (-1) in its request's row; the row's
    description comes from the first event of the request (its first settlement)."""
    model, key_id, worker_id = labels
    meta = settled["meta"]
    row = requests.get(settled["request_id"])
    if row is None:
        ttft_ms = meta.get("ttft_ms")
        row = requests[settled["request_id"]] = {
            "first": (settled["customer_account_id"], key_id, model, worker_id, ttft_ms if type(ttft_ms) is int else None,
                      generation_status(meta), event.recorded_at),
            "sums": [0] * len(GENERATION_SUMS)}
    for i, value in enumerate((meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0), settled["charge_nano_usd"],
                               settled["owner_nano_usd"])):
        row["sums"][i] += sign * int(value)
    row["seq"] = event.seq


def apply_page(conn: Connection, events: list[StoredEvent]) -> None:
    usage: dict[tuple, list[int]] = defaultdict(lambda: [0] * len(USAGE_SUMS))
    earnings: dict[tuple, list[int]] = defaultdict(lambda: [0] * len(EARNINGS_SUMS))
    requests: dict[str, dict] = {}
    postings: list[tuple] = []
    by_day: dict[tuple, list[int]] = defaultdict(lambda: [0] * len(POSTINGS_DAILY_SUMS))
    reversed_events = _reversed_events(conn, events)
    for event in events:
        payload = orjson.loads(event.payload_json)
        source_type, source, sign, day = event.event_type, payload, 1, event.recorded_at.date().isoformat()
        if event.event_type == "EventReversed":  # counts against what it reverses
            source_type, source = reversed_events[payload["reversed_seq"]]
            sign = -1
        meta = source.get("meta", {}) if source_type == "RequestSettled" else {}
        model, key_id, worker_id = str(meta.get("model", "")), int(meta.get("api_key_id") or 0), int(meta.get("worker_id") or 0)
        if source_type == "RequestSettled":
            _count_settlement(usage, earnings, source, (model, key_id, worker_id), day, sign)
            _count_generation(requests, event, source, (model, key_id, worker_id), sign)
        reference = _reference(source_type, source)
        if sign < 0:
            reference = f"reverses event {payload['reversed_seq']}: {payload['reason']} ({reference})"
        customer, owner = source.get("customer_account_id"), source.get("owner_account_id")
        for leg, (account_id, amount) in enumerate(event.postings):
            daily = by_day[(account_id, day, source_type)]
            daily[0], daily[1] = daily[0] + 1, daily[1] + amount
            # Each side sees only its own: a customer not which worker answered, an owner not whose key asked.
            postings.append((account_id, event.seq, leg, event.recorded_at, event.event_type, source_type, amount, model,
                             0 if account_id == owner else key_id, 0 if account_id == customer else worker_id,
                             reference[:REFERENCE_CHARS_MAX]))
    _add(conn, usage_daily, USAGE_KEY, USAGE_SUMS, usage)
    _add(conn, earnings_daily, EARNINGS_KEY, EARNINGS_SUMS, earnings)
    _add(conn, generations, GENERATION_KEY, GENERATION_SUMS,
         {(request_id,): (*row["first"], *row["sums"], row["seq"]) for request_id, row in requests.items()},
         kept=GENERATION_FIRST, latest=("event_seq",))
    _insert(conn, account_postings, POSTING_COLUMNS, postings)
    _add(conn, postings_daily, POSTINGS_DAILY_KEY, POSTINGS_DAILY_SUMS, by_day)


def _add(conn: Connection, table, key_names: tuple, sum_names: tuple, deltas: dict, *, kept: tuple = (),
         latest: tuple = ()) -> None:
    """Add each key's sums to its row, creating it the first time: one upsert
    for the page. Each delta is its `kept` values (written only when the row
    is created), its sums, then its `latest` values (written every time)."""
    if not deltas:
        return
    names = key_names + kept + sum_names + latest
    rows = [(*key, *values) for key, values in sorted(deltas.items())]
    if is_postgres(conn):
        updates = ", ".join([f"{name} = {table.name}.{name} + EXCLUDED.{name}" for name in sum_names]
                            + [f"{name} = EXCLUDED.{name}" for name in latest])
        sql, params = _pg_unnest_insert(table, names, rows)
        conn.exec_driver_sql(f"{sql} ON CONFLICT ({', '.join(key_names)}) DO UPDATE SET {updates}", params)
        return
    statement = sqlite.insert(table)
    updates = {name: table.c[name] + statement.excluded[name] for name in sum_names}
    updates.update({name: statement.excluded[name] for name in latest})
    conn.execute(statement.on_conflict_do_update(index_elements=list(key_names), set_=updates),
                 [dict(zip(names, row)) for row in rows])


def _insert(conn: Connection, table, names: tuple, rows: list[tuple]) -> None:
    if not rows:
        return
    if is_postgres(conn):
        conn.exec_driver_sql(*_pg_unnest_insert(table, names, rows))
    else:
        conn.execute(table.insert(), [dict(zip(names, row)) for row in rows])


def _pg_array(column) -> tuple[str, Callable]:
    """The array type a column travels as, and how its values are written (ledger.storage.pg_arrays' literals)."""
    if isinstance(column.type, UTCDateTime):
        return "timestamptz", lambda values: pg_arrays.texts([v.isoformat() for v in values])
    if isinstance(column.type, Integer):
        return "bigint", pg_arrays.nullable_ints if column.nullable else pg_arrays.ints
    return "text", pg_arrays.texts


def _pg_unnest_insert(table, names: tuple, rows: list[tuple]) -> tuple[str, dict]:
    """One INSERT for all rows on PostgreSQL: each column travels as one array literal."""
    arrays, params = [], {}
    for name, column in zip(names, zip(*rows)):
        pg_type, encode = _pg_array(table.c[name])
        arrays.append(f"%({name})s::{pg_type}[]")
        params[name] = encode(column)
    return f"INSERT INTO {table.name} ({', '.join(names)}) SELECT * FROM unnest({', '.join(arrays)})", params


def catch_up(engine: Engine, progress: Callable[[int], None] | None = None) -> int:
    """Apply what the log holds beyond the position (bounded per run); returns events read."""
    return log.catch_up(engine, CONSUMER, apply_page, pages_max=PAGES_PER_RUN_MAX, progress=progress)


def apply_next_page(engine: Engine) -> int:
    """One page of the log beyond the position, applied; returns events read (0: at the end)."""
    return log.consume_once(engine, CONSUMER, apply_page)


def catch_up_alone(engine: Engine) -> int | None:
    """`catch_up` unless another applier holds the lease (then None: it applies, not us)."""
    lease = ApplierLease(engine)
    if not lease.acquire():
        return None
    try:
        return catch_up(engine)
    finally:
        lease.release()


class ApplierLease:
    """The right to apply the read models, held by one process at a time.

    On PostgreSQL a session-level advisory lock on a connection of its own,
    kept until `release`: replicas that do not hold it skip, and an applier
    that dies releases it with its connection. On SQLite (the embedded
    default, one process) a lock of the process, per database file."""

    _sqlite_locks: dict[str, threading.Lock] = {}
    _sqlite_locks_guard = threading.Lock()

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._conn: Connection | None = None
        self._thread_lock: threading.Lock | None = None

    @property
    def held(self) -> bool:
        return self._conn is not None or self._thread_lock is not None

    def acquire(self) -> bool:
        """Without waiting: True when this lease holds the right now (a held one is checked to be still alive)."""
        if not is_postgres(self.engine):
            return self._acquire_in_process()
        if self._conn is not None and self._still_connected():
            return True
        self._drop_connection()
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")  # never idle in a transaction
        try:
            taken = conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": READ_MODELS_APPLIER_LOCK_KEY}).scalar_one()
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        if not taken:
            conn.close()
            return False
        self._conn = conn
        return True

    def release(self) -> None:
        if self._thread_lock is not None:
            self._thread_lock.release()
            self._thread_lock = None
        self._unlock()
        self._drop_connection()

    def _unlock(self) -> None:
        """Unlocked in so many words before the connection closes: a closed
        connection's lock is freed only once its server process has noticed,
        and the next applier may ask before that."""
        if self._conn is None:
            return
        try:
            self._conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": READ_MODELS_APPLIER_LOCK_KEY})
        except Exception:  # the connection is gone already, and the lock with it
            pass

    def _acquire_in_process(self) -> bool:
        if self._thread_lock is not None:
            return True
        with self._sqlite_locks_guard:
            lock = self._sqlite_locks.setdefault(str(self.engine.url), threading.Lock())
        if not lock.acquire(blocking=False):
            return False
        self._thread_lock = lock
        return True

    def _still_connected(self) -> bool:
        try:
            self._conn.execute(text("SELECT 1"))
            return True
        except Exception:  # the connection, and the lock with it, is gone: try to take it again
            logger.warning("the read models' applier lost its database connection, and the lock with it")
            return False

    def _drop_connection(self) -> None:
        """Closed for good, not returned to the pool: the session, and the lock, end with it."""
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        try:
            conn.invalidate()
        finally:
            conn.close()


def rebuild(engine: Engine, progress: Callable[[int], None] | None = None) -> int:
    """From the first event: empty the tables and the position together, then catch up to the end."""
    with engine.begin() as conn:
        # The position row first: its lock waits for a page being applied, so the deletes below see that page too.
        conn.execute(delete(consumer_positions).where(consumer_positions.c.consumer == CONSUMER))
        conn.execute(delete(usage_daily))
        conn.execute(delete(earnings_daily))
        conn.execute(delete(account_postings))
        conn.execute(delete(generations))
        conn.execute(delete(postings_daily))
    total = 0
    while read := catch_up(engine, progress):
        total += read
    return total


def lag_seconds(engine: Engine) -> float:
    """The age of the oldest event the read models have not applied (0.0 when none)."""
    with engine.connect() as conn:
        oldest = conn.execute(select(ledger_events.c.recorded_at)
                              .where(ledger_events.c.seq == consumer_position(conn, CONSUMER) + 1)).scalar()
    return 0.0 if oldest is None else max(0.0, (utc_now() - oldest).total_seconds())


def lag_events(engine: Engine) -> int:
    """How many events the read models have not applied yet."""
    with engine.connect() as conn:
        head = conn.execute(select(func.coalesce(func.max(ledger_events.c.seq), 0))).scalar_one()
        return head - consumer_position(conn, CONSUMER)
