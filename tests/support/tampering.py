"""What a superuser could do to a ledger: switch the triggers off (the
append-only log's and the balance guard's) and edit any table."""
from __future__ import annotations

from sqlalchemy import Engine, text


def tamper_as_superuser(engine: Engine, statement: str) -> None:
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SET LOCAL session_replication_role = replica"))
            conn.execute(text(statement))
            return
        triggers = conn.execute(text("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")).all()
        for name, _ in triggers:
            conn.execute(text(f'DROP TRIGGER "{name}"'))
        conn.execute(text(statement))
        for _, sql in triggers:
            conn.execute(text(sql))
