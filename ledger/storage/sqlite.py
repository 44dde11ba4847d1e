"""SQLite, the embedded default: the same rows through executemany.

One writer at a time: every transaction takes SQLite's write lock at BEGIN
(`BEGIN IMMEDIATE`), so read-then-write transactions serialise as row locks
make them on PostgreSQL, and every commit is flushed (`synchronous=FULL`).
"""
from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import Connection, Engine, bindparam, create_engine, delete, event, select, update
from sqlalchemy.engine import URL

from ledger.errors import BadDatabaseUrl, LedgerError
from ledger.hold_commands import HoldRenewal, HoldResult, PlaceHold
from ledger.limits import MS_PER_S, SQLITE_BUSY_TIMEOUT_MS
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
from ledger.storage.base import (
    EVENT_COLUMNS,
    HOLD_ROW,
    POSTING_COLUMNS,
    AppendedBatch,
    ClosedHold,
    HeadRead,
    HoldRules,
    Storage,
)

_SET_BALANCE = (
    update(account_balances)
    .where(account_balances.c.account_id == bindparam("b_account_id"))
    .values(
        balance_nano_usd=bindparam("b_balance"),
        last_event_seq=bindparam("b_seq"),
        # Added to, not set: releases change it without the append lock.
        holds_closed_nano_usd=account_balances.c.holds_closed_nano_usd + bindparam("b_closed"),
    )
)
_ADD_CLOSED = (
    update(account_balances)
    .where(account_balances.c.account_id == bindparam("b_id"))
    .values(holds_closed_nano_usd=account_balances.c.holds_closed_nano_usd + bindparam("b_amount"))
)
_ADD_PLACED = (
    update(customer_holds)
    .where(customer_holds.c.account_id == bindparam("b_id"))
    .values(holds_placed_nano_usd=customer_holds.c.holds_placed_nano_usd + bindparam("b_amount"))
)
_ADD_LIMIT_PLACED = (
    update(spend_limit_holds).where(spend_limit_holds.c.limit_id == bindparam("b_id"))
    .values(holds_placed_nano_usd=spend_limit_holds.c.holds_placed_nano_usd + bindparam("b_amount"))
)
_ADD_LIMIT_USAGE = (
    update(spend_limit_usage).where(spend_limit_usage.c.limit_id == bindparam("b_limit_id"))
    .values(spent_nano_usd=spend_limit_usage.c.spent_nano_usd + bindparam("b_spent"),
            holds_closed_nano_usd=spend_limit_usage.c.holds_closed_nano_usd + bindparam("b_closed"))
)
_CLOSE_HOLD = delete(holds).where(holds.c.id == bindparam("b_id")).returning(*(holds.c[name] for name in HOLD_ROW))


class SqliteStorage(Storage):
    dialect = "sqlite"
    url_backends = ("sqlite",)
    holds_in_one_statement = False
    commits_flushed = True

    def engine_url(self, url: URL) -> URL:
        if not url.database or url.database == ":memory:":
            raise BadDatabaseUrl("SQLite needs a file path (sqlite:///path/to/file.db): the ledger must outlive the process")
        return url.set(drivername="sqlite+pysqlite")

    def snapshot_connection(self, engine: Engine) -> Connection:
        return engine.connect()  # its transaction begins IMMEDIATE: no append runs until it ends

    def create_engine(self, url: URL, *, pool_size: int) -> Engine:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / MS_PER_S, "check_same_thread": False})
        _make_transactional(engine)
        return engine

    def skip_flush_wait(self, conn: Connection, *, with_next_statement: bool = False) -> None:
        """Every SQLite commit is flushed: holds too."""

    def wait_for_flush(self, conn: Connection) -> None:
        """Every SQLite commit is flushed already."""

    def is_retryable_error(self, error: BaseException | None) -> bool:
        return "UNIQUE constraint failed" in str(error)

    def one_of(self, column, values: list):
        return column.in_(values)

    def lock_head_and_read(self, conn: Connection, keys: list[str], account_ids: list[int],
                           holds_closed: dict[int, int] | None = None) -> HeadRead:
        last_seq, last_hash = conn.execute(
            select(ledger_head.c.last_seq, ledger_head.c.last_hash).where(ledger_head.c.id == 1).with_for_update()
        ).one()
        return HeadRead(last_seq, last_hash, self.read_known_keys(conn, keys), self.read_balances(conn, account_ids))

    def write_appended(self, conn: Connection, batch: AppendedBatch) -> None:
        conn.execute(ledger_events.insert(), [{**dict(zip(EVENT_COLUMNS, row)), "recorded_at": batch.recorded_at}
                                              for row in batch.event_rows()])
        if posting_rows := batch.posting_rows():
            conn.execute(ledger_postings.insert(), [dict(zip(POSTING_COLUMNS, row)) for row in posting_rows])
        if batch.balances:  # a batch of events that move no money has none
            conn.execute(_SET_BALANCE, [{"b_account_id": a, "b_balance": batch.balances[a], "b_seq": batch.last_seq,
                                         "b_closed": batch.holds_closed.get(a, 0)} for a in sorted(batch.balances)])
        self.add_limit_usage(conn, batch.limit_usage)
        conn.execute(update(ledger_head).where(ledger_head.c.id == 1).values(last_seq=batch.last_seq, last_hash=batch.last_hash))

    def place_holds(self, conn: Connection, requests: list[PlaceHold], rules: HoldRules) -> list[HoldResult | LedgerError]:
        """The rules run here, in this process."""
        return rules(conn, requests)

    def insert_holds(self, conn: Connection, rows: list[tuple], now: datetime) -> dict[str, int]:
        if not rows:
            return {}
        values = [
            {"account_id": a, "amount_nano_usd": m, "idempotency_key": k,
             "created_at": now, "expires_at": now + timedelta(seconds=ttl), "spend_limit_id": limit_id,
             "replica_id": replica_id}
            for a, m, k, ttl, limit_id, replica_id in rows
        ]
        inserted = conn.execute(holds.insert().returning(holds.c.id, holds.c.idempotency_key, sort_by_parameter_order=True), values)
        return {key: hold_id for hold_id, key in inserted}

    def renew_holds(self, conn: Connection, renewals: list[HoldRenewal], metas: list[str | None], now: datetime) -> set[int]:
        renewed = set()
        for renewal, meta in zip(renewals, metas):
            row = conn.execute(select(holds.c.amount_nano_usd, holds.c.capture_nano_usd).where(holds.c.id == renewal.hold_id)).first()
            if row is None:
                continue
            values: dict = {"expires_at": now + timedelta(seconds=renewal.ttl_s)}
            if renewal.capture_nano_usd:
                values.update(capture_nano_usd=min(row.amount_nano_usd, max(row.capture_nano_usd, renewal.capture_nano_usd)),
                              capture_owner_account_id=renewal.owner_account_id, capture_request_id=renewal.request_id,
                              capture_meta=meta)
            conn.execute(update(holds).where(holds.c.id == renewal.hold_id).values(**values))
            renewed.add(renewal.hold_id)
        return renewed

    def close_holds(self, conn: Connection, hold_ids: list[int]) -> list[ClosedHold]:
        closed = []
        for hold_id in hold_ids:  # executemany cannot return rows
            closed.extend(ClosedHold(r.id, r.account_id, r.amount_nano_usd, r.spend_limit_id, tuple(r))
                          for r in conn.execute(_CLOSE_HOLD, {"b_id": hold_id}))
        return closed

    def add_holds_placed(self, conn: Connection, placed: dict[int, int]) -> None:
        _add(conn, _ADD_PLACED, placed)

    def add_holds_closed(self, conn: Connection, closed: dict[int, int]) -> None:
        _add(conn, _ADD_CLOSED, closed)

    def add_limit_placed(self, conn: Connection, placed: dict[int, int]) -> None:
        _add(conn, _ADD_LIMIT_PLACED, placed)

    def add_limit_usage(self, conn: Connection, usage: dict[int, tuple[int, int]]) -> None:
        if usage:
            conn.execute(_ADD_LIMIT_USAGE, [{"b_limit_id": i, "b_spent": spent, "b_closed": closed}
                                            for i, (spent, closed) in sorted(usage.items())])


def _add(conn: Connection, statement, amounts: dict[int, int]) -> None:
    if amounts:
        conn.execute(statement, [{"b_id": i, "b_amount": amounts[i]} for i in sorted(amounts)])


def _make_transactional(engine: Engine) -> None:
    """pysqlite's own BEGIN handling is lazy; take the write lock at BEGIN so
    read-then-write transactions serialise like PostgreSQL's row locks."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
