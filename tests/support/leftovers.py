"""Names of the databases and roles a test session creates, and the sweep of
those a killed session left behind.

A session drops what it creates when it ends; one killed midway (a CI run
stopped by its time limit, a kill -9) never runs its finalisers, and its
databases and roles stay on the shared server. Every name carries the second
it was made, so the next session can drop those older than any session lives,
and nothing of a session that may still be running, nor anything named
otherwise, is touched."""
from __future__ import annotations

import re
import time
import uuid

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

# Longer than a CI run lives (killed at 90 minutes) with room to spare.
LEFTOVER_AGE_S = 6 * 3600
_NAMED = re.compile(r"^paralon_(?:test|app)_[a-z0-9]+_(?P<made_s>\d{10})_[0-9a-f]{12}$")


def session_name(kind: str, worker: str) -> str:
    """`paralon_<kind>_<worker>_<unix seconds>_<random>`: unique, and dated for the sweep."""
    return f"paralon_{kind}_{worker or 'main'}_{int(time.time())}_{uuid.uuid4().hex[:12]}"


def is_leftover(name: str, now_s: float) -> bool:
    named = _NAMED.match(name)
    return named is not None and now_s - int(named["made_s"]) > LEFTOVER_AGE_S


def sweep_leftovers(admin: Connection, now_s: float | None = None) -> list[str]:
    """Drop the test databases, then the roles, that a session older than
    LEFTOVER_AGE_S left; returns their names. What cannot be dropped (another
    login's database, a role still granted on a database that stays) is let be:
    a sweep never fails a run."""
    now_s = time.time() if now_s is None else now_s
    databases = [n for n in admin.execute(text("SELECT datname FROM pg_database")).scalars() if is_leftover(n, now_s)]
    roles = [n for n in admin.execute(text("SELECT rolname FROM pg_roles")).scalars() if is_leftover(n, now_s)]
    statements = [f'DROP DATABASE IF EXISTS "{d}" WITH (FORCE)' for d in databases] + [f'DROP ROLE IF EXISTS "{r}"' for r in roles]
    dropped = []
    for name, statement in zip(databases + roles, statements, strict=True):
        try:
            admin.execute(text(statement))
            dropped.append(name)
        except DBAPIError:  # another login's, or a role still granted somewhere: not this run's to force
            continue
    return dropped
