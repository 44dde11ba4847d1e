"""The ledger's tests run on SQLite, on PostgreSQL with postings as rows, and
on PostgreSQL with postings in their event's row (migration 0031)."""
from __future__ import annotations

import pytest

from ledger.db import make_engine
from ledger.store import set_postings_in_event_row
from tests.conftest import migrated_database_url

IN_EVENT_ROW = "postgresql-postings-in-event-row"


def put_postings_in_event_row(url: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            set_postings_in_event_row(conn, True)
    finally:
        engine.dispose()


def _migrated(request, tmp_path, layout: str) -> str:
    url = migrated_database_url(request, "sqlite" if layout == "sqlite" else "postgresql", tmp_path)
    if layout == IN_EVENT_ROW:
        put_postings_in_event_row(url)
    return url


@pytest.fixture(params=["sqlite", "postgresql", IN_EVENT_ROW])
def database_url(request, tmp_path) -> str:
    """A migrated database of the test's own, on each storage and postings layout."""
    return _migrated(request, tmp_path, request.param)


@pytest.fixture(params=["postgresql", IN_EVENT_ROW])
def postgres_url(request, tmp_path) -> str:
    """A migrated PostgreSQL database of the test's own, in each postings layout."""
    return _migrated(request, tmp_path, request.param)
