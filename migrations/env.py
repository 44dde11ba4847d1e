"""Alembic environment: one set of revisions for PostgreSQL and SQLite."""
from __future__ import annotations

from alembic import context

from app.db_roles import harden_functions
from ledger.schema import metadata


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        from app.settings import Settings
        from ledger.db import make_engine

        engine = make_engine(Settings.from_env().database.url)
        with engine.begin() as connection:
            _run(connection)
        engine.dispose()
    else:
        _run(connection)


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
        if connection.dialect.name == "postgresql":  # however the revisions were run: `paralon migrate` or alembic's own command
            harden_functions(connection)


if context.is_offline_mode():
    raise SystemExit("offline SQL generation is not supported: run `paralon migrate`")
run_migrations_online()
