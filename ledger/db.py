"""Engines for PostgreSQL and SQLite, with the same transaction semantics on both.

The storage a URL names builds the engine (`ledger.storage`), and
`storage_of` finds it again from any connection: everything database-specific
happens there.
"""
from __future__ import annotations

import logging
import time

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ledger.errors import BadDatabaseUrl
from ledger.limits import POOL_CONNECTIONS_DEFAULT
from ledger.storage.base import Storage
from ledger.storage.postgres import PostgresStorage
from ledger.storage.sqlite import SqliteStorage

__all__ = ["APPEND_MARKS", "CHAINED", "COMMITTED", "LOCK_TAKEN", "WRITTEN", "mark_append", "BadDatabaseUrl", "STORAGES",
           "DATABASE_ERRORS", "normalise_url", "make_engine", "storage_of", "is_postgres", "snapshot_connection",
           "is_connection_failure", "discard_connection"]

log = logging.getLogger(__name__)

STORAGES: tuple[Storage, ...] = (PostgresStorage(), SqliteStorage())
# In a connection's `info`: the moments (`time.perf_counter()`) its append
# took the lock and finished each part under it, so a writer can count how
# long it held the lock and on what.
APPEND_MARKS = "paralon_append_marks"
LOCK_TAKEN, CHAINED, WRITTEN, COMMITTED = "lock_taken", "chained", "written", "committed"


def mark_append(conn: Connection, moment: str) -> None:
    """Note that an append under the lock reached `moment`. LOCK_TAKEN starts
    the list afresh: an append outside a writer leaves its marks to the next."""
    mark = (moment, time.perf_counter())
    if moment == LOCK_TAKEN:
        conn.info[APPEND_MARKS] = [mark]
    else:
        conn.info.setdefault(APPEND_MARKS, []).append(mark)


_BY_DIALECT = {storage.dialect: storage for storage in STORAGES}
_BY_BACKEND = {backend: storage for storage in STORAGES for backend in storage.url_backends}
_DRIVER_CONNECTION_ERRORS = tuple(error for storage in STORAGES for error in storage.driver_connection_errors)
# Every error a database call can raise for the database's sake: SQLAlchemy's,
# its pool's, and the drivers' own from statements run on the raw connection.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (DBAPIError, PoolTimeout, *_DRIVER_CONNECTION_ERRORS)


def is_connection_failure(exc: BaseException) -> bool:
    """The database could not be reached or the connection broke: worth a new
    connection and another try, and an answer of "unavailable, try again" to
    a caller, never "internal error"."""
    if isinstance(exc, PoolTimeout):  # every connection is busy reconnecting, or the pool is exhausted
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig
    return any(storage.is_connection_error(exc) for storage in STORAGES)


def discard_connection(conn: Connection | None) -> None:
    """The connection failed: the pool must never hand it out again."""
    if conn is None:
        return
    try:
        conn.invalidate()
        conn.close()
    except Exception:  # it is gone either way
        log.debug("closing a failed connection", exc_info=True)


def storage_of(conn_or_engine: Connection | Engine) -> Storage:
    return _BY_DIALECT[conn_or_engine.dialect.name]


def _storage_for(url: URL) -> Storage:
    backend = url.get_backend_name()
    try:
        return _BY_BACKEND[backend]
    except KeyError:
        raise BadDatabaseUrl(f"unsupported database {backend!r}: use postgresql://… or sqlite:///…") from None


def normalise_url(raw: str) -> URL:
    """Accept plain `postgresql://…` and `sqlite:///…`; pick the drivers Paralon ships."""
    try:
        url = make_url(raw)
    except (ArgumentError, ValueError) as exc:
        raise BadDatabaseUrl(f"malformed database URL {raw!r}: {exc}") from None
    return _storage_for(url).engine_url(url)


def make_engine(raw_url: str, *, pool_size: int = POOL_CONNECTIONS_DEFAULT) -> Engine:
    url = normalise_url(raw_url)
    return _storage_for(url).create_engine(url, pool_size=pool_size)


def snapshot_connection(engine: Engine) -> Connection:
    """A connection whose reads all see one state of the ledger (for verify)."""
    return storage_of(engine).snapshot_connection(engine)


def is_postgres(conn_or_engine: Connection | Engine) -> bool:
    """For the packages around the ledger that use PostgreSQL's extras (LISTEN/NOTIFY)."""
    return isinstance(storage_of(conn_or_engine), PostgresStorage)
