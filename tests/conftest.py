"""Shared fixtures: every storage test runs on SQLite and on PostgreSQL.

A test gets a database of its own, already migrated: on PostgreSQL a clone
(`CREATE DATABASE … TEMPLATE`) of a template migrated once per test process,
on SQLite a copy of a migrated file; `empty_database_url` is for the tests of
migrations themselves. Under pytest-xdist every worker has its own template,
database names unique to it, and a Redis database of its own (`redis_url`).
Whatever a session creates it drops. On a laptop without PostgreSQL or Redis
those tests skip; in CI (PARALON_REQUIRE_SERVICES=1) a missing server is a
failure, never a skip."""
from __future__ import annotations

import functools
import os
import sqlite3
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

from app.migrate import migrate
from ledger.db import make_engine
from ledger.service import Ledger
from tests.support.db_roles import drop_app_role
from tests.support.leftovers import session_name, sweep_leftovers
from tests.support.services import REQUIRE_SERVICES, XDIST_WORKER, redis_url  # noqa: F401 (a fixture)

# Invoices issued by tests (in-process or by a `serve` they start) go to a scratch directory.
os.environ.setdefault("PARALON_INVOICE_DIR", tempfile.mkdtemp(prefix="paralon-invoices-"))

POSTGRES_ADMIN_URL = os.environ.get("PARALON_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_POOL_CONNECTIONS_TEST = 30  # the concurrency tests race dozens of threads on one engine


@functools.cache
def _admin_engine() -> Engine:
    url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg")
    return create_engine(url, isolation_level="AUTOCOMMIT", pool_size=1)


def _url_of(name: str) -> str:
    return make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)


@functools.cache
def postgres_available() -> bool:
    try:
        with _admin_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except Exception:
        if REQUIRE_SERVICES:
            raise
        return False


def new_postgres_database(template: str | None = None) -> str:
    """A database of the caller's own, empty or cloned from `template`; returns its URL."""
    if not postgres_available():
        pytest.skip("PostgreSQL is not reachable at PARALON_TEST_POSTGRES_URL")
    name = session_name("test", XDIST_WORKER)
    clause = f' TEMPLATE "{template}"' if template else ""
    with _admin_engine().connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"{clause}'))
    return _url_of(name)


def drop_postgres_database(url: str) -> None:
    name = make_url(url).database
    with _admin_engine().connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


# A test's database is dropped while the next test runs: a drop mostly waits on
# the server's disk, which is time the next test can use. The session waits for
# every drop before it ends (pytest_sessionfinish).
_dropper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drop-test-database")
_drops: list = []


def drop_postgres_database_soon(url: str) -> None:
    _drops.append(_dropper.submit(drop_postgres_database, url))


def pytest_sessionstart(session) -> None:
    """Once per run (in xdist's controller, or the one process): what killed runs left."""
    if not XDIST_WORKER and postgres_available():
        with _admin_engine().connect() as conn:
            sweep_leftovers(conn)


def pytest_sessionfinish(session, exitstatus) -> None:
    _dropper.shutdown(wait=True)
    for drop in _drops:
        drop.result()  # a drop that failed fails loudly here
    drop_app_role()  # after the databases it was granted on are gone


def _migrated(url: str) -> None:
    engine = make_engine(url)
    try:
        migrate(engine)
    finally:
        engine.dispose()  # a template must have no connection left when it is cloned


@pytest.fixture(autouse=True)
def anchor_file_of_its_own(tmp_path, monkeypatch) -> None:
    """Each test's anchors (beat's, `ledger anchor`'s, and what `ledger verify` reads)
    in a file of its own: never ./var/anchors.jsonl of `make run`, never another test's."""
    monkeypatch.setenv("PARALON_ANCHOR_FILE", str(tmp_path / "anchors.jsonl"))


@pytest.fixture(scope="session")
def postgres_template() -> str:
    """The name of a database migrated once for this test process, the template of every test's database."""
    if not postgres_available():
        pytest.skip("PostgreSQL is not reachable at PARALON_TEST_POSTGRES_URL")
    url = new_postgres_database()
    try:
        _migrated(url)
        yield make_url(url).database
    finally:
        drop_postgres_database(url)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> Path:
    """A SQLite file migrated once for this test process; tests get copies of it."""
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    _migrated(f"sqlite:///{path}")
    return path


def migrated_database_url(request, backend: str, tmp_path: Path) -> str:
    """A migrated database for one test: a clone of this process's template."""
    if backend == "sqlite":
        path = tmp_path / "paralon.db"
        with closing(sqlite3.connect(request.getfixturevalue("sqlite_template"))) as source, \
                closing(sqlite3.connect(path)) as copy:
            source.backup(copy)
        return f"sqlite:///{path}"
    url = new_postgres_database(template=request.getfixturevalue("postgres_template"))
    request.addfinalizer(lambda: drop_postgres_database_soon(url))
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> str:
    """A migrated database of the test's own, on each storage."""
    return migrated_database_url(request, request.param, tmp_path)


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database_url(request, tmp_path):
    """A database with no schema at all, on each storage: for the tests of migrations."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/paralon.db"
        return
    url = new_postgres_database()
    yield url
    drop_postgres_database_soon(url)


@pytest.fixture
def postgres_url(request, tmp_path) -> str:
    """A migrated PostgreSQL database of the test's own."""
    return migrated_database_url(request, "postgresql", tmp_path)


@pytest.fixture
def engine(database_url):
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_engine(postgres_url):
    engine = make_engine(postgres_url, pool_size=PG_POOL_CONNECTIONS_TEST)
    yield engine
    engine.dispose()


@pytest.fixture
def ledger(engine):
    ledger = Ledger(engine)
    yield ledger
    ledger.close()
