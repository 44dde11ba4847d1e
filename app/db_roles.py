"""The service's database role on PostgreSQL: it owns nothing and holds only
the rights the service uses.

Migrations run as the owner role (PARALON_MIGRATION_DATABASE_URL); the service
runs as another (PARALON_DATABASE_URL). Only an owner can disable or drop a
trigger, so the append-only triggers and the balance guard (migrations 0001,
0013) hold against the service's own credentials. Grants are re-applied at
each `paralon migrate`, so tables later migrations add are covered: a table
not named below is an ordinary table (read and write); the ledger's tables get
less. SQLite has no roles: the file's permissions are all there is.
"""
from __future__ import annotations

import re

from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url

from ledger.errors import InvalidInput

# What the service may do to each table whose rights are narrower than an
# ordinary table's (SELECT, INSERT, UPDATE, DELETE). Columns in brackets are
# the only ones it may update.
NARROW_PRIVILEGES = {
    "ledger_events": "SELECT, INSERT",
    "ledger_postings": "SELECT, INSERT",
    "ledger_head": "SELECT, UPDATE (last_seq, last_hash)",
    "account_balances": "SELECT, INSERT, UPDATE (balance_nano_usd, last_event_seq, holds_closed_nano_usd)",
    "customer_holds": "SELECT, INSERT, UPDATE (holds_placed_nano_usd)",
    "spend_limit_holds": "SELECT, INSERT, UPDATE (holds_placed_nano_usd)",
    "spend_limit_usage": "SELECT, INSERT, UPDATE (spent_nano_usd, holds_closed_nano_usd)",
    "accounts": "SELECT, INSERT, UPDATE",
    "alembic_version": "SELECT",
    "stored_responses": "SELECT, INSERT",  # written once per response, never changed
}
ORDINARY_PRIVILEGES = "SELECT, INSERT, UPDATE, DELETE"
_ROLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def check_role_name(role: str) -> str:
    if not _ROLE_NAME.fullmatch(role):
        raise InvalidInput(f"role name {role!r} must be letters, digits and _ (at most 63, not starting with a digit)")
    return role


def service_role(service_url: str, owner_url: str) -> str | None:
    """The service's role when it differs from the owner's (PostgreSQL only), else None."""
    service, owner = make_url(service_url), make_url(owner_url)
    if not service.get_backend_name().startswith("postgres") or not service.username:
        return None
    return service.username if service.username != owner.username else None


def grant_app_role(engine: Engine, role: str) -> list[str]:
    """Give `role` exactly the service's rights on every table of the schema
    (what it had before is revoked first); returns the tables granted."""
    check_role_name(role)
    if engine.dialect.name != "postgresql":
        raise InvalidInput("database roles are PostgreSQL's: a SQLite file is guarded by its file permissions")
    with engine.begin() as conn:
        _require_not_owner(conn, role)
        tables = conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1")).scalars().all()
        conn.exec_driver_sql(f'GRANT USAGE ON SCHEMA "{_schema(conn)}" TO "{role}"')
        for table in tables:
            conn.exec_driver_sql(f'REVOKE ALL ON "{table}" FROM "{role}"')
            conn.exec_driver_sql(f'GRANT {NARROW_PRIVILEGES.get(table, ORDINARY_PRIVILEGES)} ON "{table}" TO "{role}"')
        views = conn.execute(text("SELECT viewname FROM pg_views WHERE schemaname = current_schema() ORDER BY 1")).scalars().all()
        for view in views:  # read only (ledger_event_postings)
            conn.exec_driver_sql(f'REVOKE ALL ON "{view}" FROM "{role}"')
            conn.exec_driver_sql(f'GRANT SELECT ON "{view}" TO "{role}"')
        schema = _schema(conn)
        conn.exec_driver_sql(f'REVOKE CREATE ON SCHEMA "{schema}" FROM PUBLIC, "{role}"')  # no operator or function of its own beside ours
        require_no_create(conn, role, schema)
        conn.exec_driver_sql(f'GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA "{schema}" TO "{role}"')
        harden_functions(conn)  # after a restore that dropped privileges, PUBLIC's too
        for signature, is_trigger, _ in _functions(conn):
            if is_trigger:  # it only ever runs as its table's trigger
                conn.exec_driver_sql(f'REVOKE EXECUTE ON FUNCTION {signature} FROM "{role}"')
            else:
                conn.exec_driver_sql(f'GRANT EXECUTE ON FUNCTION {signature} TO "{role}"')
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        conn.exec_driver_sql(f'GRANT CONNECT ON DATABASE "{database}" TO "{role}"')
    return list(tables)


def harden_functions(conn: Connection) -> None:
    """After each migration (PostgreSQL; `migrations/env.py`): every function
    of the schema looks names up in pg_catalog first and in the caller's
    temporary schema last, so that no object a caller made (a temporary table
    named pg_class or customer_holds) stands in for the one a guard means; a
    function that runs as its owner sees pg_catalog and temporary objects
    only, and names the schema's tables itself (migration 0030). No one may
    execute a trigger function, so none can be attached to a table of a
    caller's own. A migration's CREATE OR REPLACE drops a function's
    settings: this puts them back."""
    schema = _schema(conn)
    for signature, is_trigger, runs_as_owner in _functions(conn):
        path = "pg_catalog, pg_temp" if runs_as_owner else f'pg_catalog, "{schema}", pg_temp'
        conn.exec_driver_sql(f"ALTER FUNCTION {signature} SET search_path = {path}")
        if is_trigger:
            conn.exec_driver_sql(f"REVOKE EXECUTE ON FUNCTION {signature} FROM PUBLIC")


def _functions(conn: Connection) -> list[tuple[str, bool, bool]]:
    """The functions of the schema the migrations made (the current user's, no
    extension's): (signature, whether it is a trigger function, whether it runs as its owner)."""
    return [tuple(row) for row in conn.execute(text(
        "SELECT p.oid::regprocedure::text, p.prorettype = 'trigger'::regtype, p.prosecdef FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace JOIN pg_roles r ON r.oid = p.proowner "
        "WHERE n.nspname = current_schema() AND r.rolname = current_user AND p.prokind = 'f' "
        "AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e') "
        "ORDER BY 1")).all()]


def require_no_create(conn: Connection, role: str, schema: str) -> None:
    """The revoke does nothing where this role does not own the schema (PostgreSQL
    before 15 let everyone create in `public`, owned by the superuser)."""
    if conn.execute(text("SELECT has_schema_privilege(:r, :s, 'CREATE')"), {"r": role, "s": schema}).scalar_one():
        raise InvalidInput(f"role {role!r} may create objects in schema {schema!r}, where the ledger's functions look names up: "
                           f"as the schema's owner, REVOKE CREATE ON SCHEMA \"{schema}\" FROM PUBLIC, {role}")


def _schema(conn: Connection) -> str:
    return conn.execute(text("SELECT current_schema()")).scalar_one()


def _require_not_owner(conn: Connection, role: str) -> None:
    row = conn.execute(text("SELECT rolsuper, pg_has_role(:r, current_user, 'MEMBER') FROM pg_roles WHERE rolname = :r"),
                       {"r": role}).one_or_none()
    if row is None:
        raise InvalidInput(f"role {role!r} does not exist: create it first (CREATE ROLE {role} LOGIN PASSWORD '...')")
    superuser, owns = row
    if superuser or owns:
        raise InvalidInput(f"role {role!r} is a superuser or the owner role itself: the service must run as a role that owns nothing")
