"""Shared fixtures: every storage test runs on SQLite and on PostgreSQL.

PostgreSQL tests use a database of their own, created and dropped here. On a
laptop without PostgreSQL they skip; in CI (PARALON_REQUIRE_SERVICES=1) a
missing server is a failure, never a skip."""
from __future__ import annotations

import os
import tempfile
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from app.migrate import migrate
from ledger.db import make_engine
from ledger.service import Ledger

# Invoices issued by tests (in-process or by a `serve` they start) go to a scratch directory.
os.environ.setdefault("PARALON_INVOICE_DIR", tempfile.mkdtemp(prefix="paralon-invoices-"))

POSTGRES_ADMIN_URL = os.environ.get("PARALON_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REQUIRE_SERVICES = os.environ.get("PARALON_REQUIRE_SERVICES") == "1"


def _admin_engine():
    url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg")
    return create_engine(url, isolation_level="AUTOCOMMIT")


def postgres_available() -> bool:
    try:
        with _admin_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except Exception:
        if REQUIRE_SERVICES:
            raise
        return False


def new_postgres_database() -> str:
    if not postgres_available():
        pytest.skip("PostgreSQL is not reachable at PARALON_TEST_POSTGRES_URL")
    name = f"paralon_test_{uuid.uuid4().hex[:12]}"
    with _admin_engine().connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(url: str) -> None:
    name = make_url(url).database
    with _admin_engine().connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/paralon.db"
        return
    url = new_postgres_database()
    yield url
    drop_postgres_database(url)


@pytest.fixture
def postgres_url():
    url = new_postgres_database()
    yield url
    drop_postgres_database(url)


@pytest.fixture
def engine(database_url):
    engine = make_engine(database_url)
    migrate(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_engine(postgres_url):
    engine = make_engine(postgres_url, pool_size=30)
    migrate(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def ledger(engine):
    ledger = Ledger(engine)
    yield ledger
    ledger.close()
