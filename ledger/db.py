"""Engines for PostgreSQL and SQLite, with the same transaction semantics on both.

The storage a URL names builds the engine (`ledger.storage`), and
`storage_of` finds it again from any connection: everything database-specific
happens there.
"""
from __future__ import annotations

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from ledger.errors import BadDatabaseUrl
from ledger.limits import POOL_CONNECTIONS_DEFAULT
from ledger.storage.base import Storage
from ledger.storage.postgres import PostgresStorage
from ledger.storage.sqlite import SqliteStorage

__all__ = ["BadDatabaseUrl", "STORAGES", "normalise_url", "make_engine", "storage_of", "is_postgres", "snapshot_connection"]

STORAGES: tuple[Storage, ...] = (PostgresStorage(), SqliteStorage())
_BY_DIALECT = {storage.dialect: storage for storage in STORAGES}
_BY_BACKEND = {backend: storage for storage in STORAGES for backend in storage.url_backends}


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
