"""The storage contract on SQLite, and what only SQLite's storage promises."""
from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest

from ledger.db import storage_of
from ledger.storage.sqlite import SqliteStorage
from tests.conftest import migrated_database_url
from tests.ledger.storage.contract import StorageContract


class TestSqliteStorage(StorageContract):
    @pytest.fixture
    def storage_url(self, request, tmp_path) -> str:
        return migrated_database_url(request, "sqlite", tmp_path)

    def test_it_is_the_sqlite_storage(self, storage):
        assert isinstance(storage, SqliteStorage) and not storage.holds_in_one_statement

    def test_every_connection_is_durable_and_checks_foreign_keys(self, engine):
        with engine.connect() as conn:
            pragmas = {name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()
                       for name in ("journal_mode", "synchronous", "foreign_keys")}
        assert pragmas == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1}  # 2: FULL

    def test_a_transaction_takes_the_write_lock_at_begin(self, engine):
        """Read-then-write transactions serialise as row locks make them on PostgreSQL."""
        with engine.begin() as conn:
            storage_of(conn).skip_flush_wait(conn)  # nothing to skip: every commit is flushed
            with closing(sqlite3.connect(engine.url.database, timeout=0)) as other:
                with pytest.raises(sqlite3.OperationalError, match="locked"):
                    other.execute("BEGIN IMMEDIATE")  # before the first transaction ran any statement
