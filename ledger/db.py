"""Engines for PostgreSQL and SQLite, with the same transaction semantics on both."""
from __future__ import annotations

from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from ledger.errors import InvalidInput

SQLITE_BUSY_TIMEOUT_MS = 30_000


class BadDatabaseUrl(InvalidInput):
    code = "bad_database_url"


def normalise_url(raw: str) -> URL:
    """Accept plain `postgresql://…` and `sqlite:///…`; pick the drivers Paralon ships."""
    try:
        url = make_url(raw)
    except (ArgumentError, ValueError) as exc:
        raise BadDatabaseUrl(f"malformed database URL {raw!r}: {exc}") from None
    backend = url.get_backend_name()
    if backend in ("postgresql", "postgres"):
        if not url.database:
            raise BadDatabaseUrl(f"database URL {url.render_as_string(hide_password=True)!r} names no database")
        return url.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        if not url.database or url.database == ":memory:":
            raise BadDatabaseUrl("SQLite needs a file path (sqlite:///path/to/file.db): the ledger must outlive the process")
        return url.set(drivername="sqlite+pysqlite")
    raise BadDatabaseUrl(f"unsupported database {backend!r}: use postgresql://… or sqlite:///…")


def make_engine(raw_url: str, *, pool_size: int = 10) -> Engine:
    url = normalise_url(raw_url)
    if url.get_backend_name() == "sqlite":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False})
        _make_sqlite_transactional(engine)
        return engine
    # No server-side prepared statements: batch statements take arrays whose
    # length varies, and a generic plan (estimated for ten elements, on whatever
    # statistics were current) can turn a thousand-row join quadratic. Planning
    # each batch statement afresh costs microseconds per batch.
    return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True,
                         connect_args={"prepare_threshold": None})


def _make_sqlite_transactional(engine: Engine) -> None:
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


def is_postgres(conn_or_engine: Connection | Engine) -> bool:
    return conn_or_engine.dialect.name == "postgresql"


def skip_flush_wait(conn: Connection) -> None:
    """This transaction's commit does not wait for the WAL flush (PostgreSQL).

    Used for holds only: every replica sees them at once, and a crash can only
    lose holds, which never costs a customer anything."""
    if is_postgres(conn):
        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
