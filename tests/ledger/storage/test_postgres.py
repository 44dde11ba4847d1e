"""The storage contract on PostgreSQL, and what only PostgreSQL's storage promises."""
from __future__ import annotations

import pytest

from ledger import holds as hl
from ledger.storage.postgres import PostgresStorage
from tests.conftest import migrated_database_url
from tests.ledger.storage.contract import PLACEMENT_ANSWERS, StorageContract, _placement


class TestPostgresStorage(StorageContract):
    @pytest.fixture
    def storage_url(self, request, tmp_path) -> str:
        return migrated_database_url(request, "postgresql", tmp_path)

    def test_it_is_the_postgres_storage(self, storage):
        assert isinstance(storage, PostgresStorage) and storage.holds_in_one_statement

    def test_the_server_function_and_the_rules_in_this_process_answer_alike(self, engine, customer):
        """Holds are placed by migration 0010's function; the same rules, run
        statement by statement here, give the same answers."""
        assert _placement(engine, customer, hl._place_holds_here) == PLACEMENT_ANSWERS

    def test_a_transaction_that_skips_the_flush_wait_commits_without_it(self, engine, storage):
        with engine.begin() as conn:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
            storage.skip_flush_wait(conn)
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "off"
        with engine.begin() as conn:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on", "for that transaction only"

    def test_no_statement_is_prepared_on_the_server(self, engine):
        """A plan prepared for a ten-element array can turn a thousand-row batch quadratic."""
        with engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold is None
