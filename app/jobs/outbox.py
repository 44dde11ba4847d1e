"""The outbox: a task is written in the transaction that makes it necessary,
and sent to Celery only after that transaction commits. Whatever was written
but not sent (the process stopped in between) is sent by the next dispatch,
which beat runs every few seconds. Tasks are safe to run twice."""
from __future__ import annotations

import orjson
from sqlalchemy import Connection, Engine, select, update

from app.schema import outbox
from ledger.schema import utc_now

DISPATCH_BATCH_MAX = 500


def add(conn: Connection, task: str, *args) -> None:
    conn.execute(outbox.insert().values(task=task, args=orjson.dumps(list(args)).decode(), created_at=utc_now()))


def dispatch(engine: Engine) -> int:
    """Send what committed tasks are waiting; returns how many were sent."""
    from app.jobs.celery import celery

    with engine.connect() as conn:
        waiting = conn.execute(select(outbox).where(outbox.c.dispatched_at.is_(None)).order_by(outbox.c.id).limit(DISPATCH_BATCH_MAX)).all()
    for row in waiting:  # sent first, marked after: a task may go twice, never not at all
        args = orjson.loads(row.args)
        if celery.conf.task_always_eager:
            celery.tasks[row.task].apply(args=args)
        else:
            celery.send_task(row.task, args=args)
        with engine.begin() as conn:
            conn.execute(update(outbox).where(outbox.c.id == row.id).values(dispatched_at=utc_now()))
    return len(waiting)
