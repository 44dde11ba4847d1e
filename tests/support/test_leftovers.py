"""What a killed test run left on the shared server is dropped by the next run, and nothing else."""
from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import _admin_engine, postgres_available
from tests.support.leftovers import LEFTOVER_AGE_S, is_leftover, session_name, sweep_leftovers


def made_long_ago(kind: str) -> str:
    """A name as a session made it a minute past the sweep's age."""
    return f"paralon_{kind}_gw9_{int(time.time()) - LEFTOVER_AGE_S - 60}_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def admin():
    if not postgres_available():
        pytest.skip("PostgreSQL is not reachable at PARALON_TEST_POSTGRES_URL")
    return _admin_engine()


def test_only_names_of_a_session_older_than_any_run_are_leftovers():
    now_s = time.time()
    fresh = session_name("test", "gw0")
    assert not is_leftover(fresh, now_s)
    assert is_leftover(fresh, now_s + LEFTOVER_AGE_S + 1)
    assert not is_leftover(fresh, now_s + LEFTOVER_AGE_S - 60)
    assert is_leftover(session_name("app", ""), now_s + LEFTOVER_AGE_S + 1)
    for foreign in (f"paralon_test_gw0_{uuid.uuid4().hex[:12]}",  # undated: its age is unknown
                    f"paralon_bench_{int(now_s) - 10 * LEFTOVER_AGE_S}_{uuid.uuid4().hex[:12]}",
                    "postgres", f"someone_test_gw0_{int(now_s) - 10 * LEFTOVER_AGE_S}_{uuid.uuid4().hex[:12]}"):
        assert not is_leftover(foreign, now_s)


def test_the_sweep_drops_old_databases_and_roles_and_leaves_the_rest(admin):
    old_database, old_role = made_long_ago("test"), made_long_ago("app")
    fresh_database = session_name("test", "gw9")
    undated_database = f"paralon_test_gw9_{uuid.uuid4().hex[:12]}"
    kept = (fresh_database, undated_database)
    with admin.connect() as conn:
        try:
            for database in (old_database, *kept):
                conn.execute(text(f'CREATE DATABASE "{database}"'))
            conn.execute(text(f'CREATE ROLE "{old_role}" NOLOGIN'))
            dropped = sweep_leftovers(conn)
            assert old_database in dropped and old_role in dropped
            assert not set(kept) & set(dropped)
            databases = set(conn.execute(text("SELECT datname FROM pg_database")).scalars())
            roles = set(conn.execute(text("SELECT rolname FROM pg_roles")).scalars())
            assert old_database not in databases and old_role not in roles
            assert set(kept) <= databases
        finally:
            for database in (old_database, *kept):
                conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
            conn.execute(text(f'DROP ROLE IF EXISTS "{old_role}"'))


def test_what_the_sweep_may_not_drop_is_let_be_and_the_run_goes_on(admin):
    """On a server shared with other logins the sweep may meet a leftover it
    does not own: the drop is refused, and the sweep neither fails nor retries it."""
    others, login = made_long_ago("test"), f"sweeper_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{others}"'))
        conn.execute(text(f'CREATE ROLE "{login}" LOGIN NOSUPERUSER'))
    weak = create_engine(admin.url.set(username=login, password=None), isolation_level="AUTOCOMMIT", pool_size=1)
    try:
        with weak.connect() as conn:
            assert others not in sweep_leftovers(conn)
        with admin.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM pg_database WHERE datname = :n"), {"n": others}).scalar_one() == 1
    finally:
        weak.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{others}" WITH (FORCE)'))
            conn.execute(text(f'DROP ROLE IF EXISTS "{login}"'))
