"""The service's own database role in tests: `paralon serve` on PostgreSQL runs
as a role that owns nothing, as in production, so a missing grant fails a test.

One role per test process (roles are cluster-wide: a unique name, created on
first use, granted on each database the process serves, dropped at session
end with its grants). SQLite has no roles: its URLs pass through."""
from __future__ import annotations

import functools
import os

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

from app.db_roles import grant_app_role
from ledger.db import make_engine
from tests.support.leftovers import session_name
from tests.support.services import XDIST_WORKER

POSTGRES_ADMIN_URL = os.environ.get("PARALON_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
APP_ROLE = session_name("app", XDIST_WORKER)
_granted_databases: set[str] = set()


@functools.cache
def _admin() -> Engine:
    return create_engine(make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT",
                         pool_size=1)


@functools.cache
def _create_role() -> str:
    with _admin().connect() as conn:
        conn.execute(text(f'CREATE ROLE "{APP_ROLE}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE'))
    return APP_ROLE


def app_role_url(database_url: str) -> str:
    """The URL of the same database as the service's role, granted what `paralon migrate` grants it."""
    url = make_url(database_url)
    if not url.get_backend_name().startswith("postgres"):
        return database_url
    role = _create_role()
    owner = make_engine(database_url)
    try:
        grant_app_role(owner, role)
    finally:
        owner.dispose()
    _granted_databases.add(url.database)
    return url.set(username=role, password=None).render_as_string(hide_password=False)


def drop_app_role() -> None:
    """At session end, after the databases are dropped: whatever grants are left, then the role."""
    if not _create_role.cache_info().currsize:
        return
    with _admin().connect() as conn:
        left = conn.execute(text("SELECT datname FROM pg_database WHERE datname = ANY(:names)"),
                            {"names": sorted(_granted_databases)}).scalars().all()
    for database in left:
        engine = create_engine(make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=database),
                               isolation_level="AUTOCOMMIT", pool_size=1)
        try:
            with engine.connect() as conn:
                conn.execute(text(f'DROP OWNED BY "{APP_ROLE}"'))
        finally:
            engine.dispose()
    with _admin().connect() as conn:
        conn.execute(text(f'DROP ROLE IF EXISTS "{APP_ROLE}"'))
