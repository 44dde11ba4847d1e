"""The outbox: a task is written in the transaction that makes it necessary,
and sent only after that transaction commits, by whoever committed it
(`dispatch` with a send function). Whatever was written but not sent (the
process stopped in between) is sent by the next dispatch, which beat runs
every few seconds. Tasks are safe to run twice."""
from __future__ import annotations

from collections.abc import Callable

import orjson
from sqlalchemy import Column, Connection, Engine, String, Table, Text, select, update

from app.limits import OUTBOX_DISPATCH_TASKS_MAX, OUTBOX_TASK_NAME_CHARS_MAX
from ledger.schema import BigId, UTCDateTime, metadata, utc_now

outbox = Table(
    "outbox",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("task", String(OUTBOX_TASK_NAME_CHARS_MAX), nullable=False),
    Column("args", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("dispatched_at", UTCDateTime),
)

# Sends one task by name with its positional arguments (a queue, or a run in-process).
SendTask = Callable[[str, list], object]


def add(conn: Connection, task: str, *args) -> None:
    conn.execute(outbox.insert().values(task=task, args=orjson.dumps(list(args)).decode(), created_at=utc_now()))


def dispatch(engine: Engine, send: SendTask) -> int:
    """Send what committed tasks are waiting; returns how many were sent."""
    with engine.connect() as conn:
        waiting = conn.execute(select(outbox).where(outbox.c.dispatched_at.is_(None)).order_by(outbox.c.id)
                               .limit(OUTBOX_DISPATCH_TASKS_MAX)).all()
    for row in waiting:  # sent first, marked after: a task may go twice, never not at all
        send(row.task, orjson.loads(row.args))
        with engine.begin() as conn:
            conn.execute(update(outbox).where(outbox.c.id == row.id).values(dispatched_at=utc_now()))
    return len(waiting)
