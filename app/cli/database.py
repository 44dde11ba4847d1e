"""`paralon db`: the database roles (README, "Database roles")."""
from __future__ import annotations

import click

from app.cli.output import emit, handles_errors, json_option, owner_engine
from app.db_roles import grant_app_role


@click.group("db")
def db_group() -> None:
    """The owner role and the service's role (PostgreSQL)."""


@db_group.command("grant-app")
@click.argument("role")
@json_option
@handles_errors
def grant_app(role: str, as_json: bool) -> None:
    """Grant ROLE the service's rights, and no more, on every table (run with the owner's URL,
    PARALON_MIGRATION_DATABASE_URL). `paralon migrate` does it too when PARALON_DATABASE_URL names ROLE."""
    tables = grant_app_role(owner_engine(), role)
    emit(as_json, {"role": role, "tables": len(tables)}, f"role {role} granted the service's rights on {len(tables)} tables")


COMMANDS = (db_group,)
