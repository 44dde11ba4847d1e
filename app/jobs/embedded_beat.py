"""The beat of the embedded default: with no broker there is no `paralon beat`,
so `paralon up` runs the same schedule itself, each due task in a thread, one
at a time (the read models, the outbox, the deposit scan, the monthly statements,
the low-balance alerts)."""
from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

from celery.schedules import maybe_schedule

from app.jobs.celery import celery
from app.limits import EMBEDDED_BEAT_TICK_S

NEVER = datetime.fromtimestamp(0, UTC)  # a last run long before any schedule: every entry is due at start
log = logging.getLogger("paralon.beat")


def due_tasks(last_run_at: dict[str, datetime]) -> list[str]:
    """Names of the beat entries due now; their last run becomes now."""
    due = []
    for name, entry in celery.conf.beat_schedule.items():
        is_due, _ = maybe_schedule(entry["schedule"], app=celery).is_due(last_run_at[name])
        if is_due:
            last_run_at[name] = datetime.now(UTC)
            due.append(name)
    return due


async def run_embedded_beat(tick_s: float = EMBEDDED_BEAT_TICK_S) -> None:
    """Every entry runs once at start (what a stopped laptop missed), then when due."""
    last_run_at = {name: NEVER for name in celery.conf.beat_schedule}
    while True:
        for name in due_tasks(last_run_at):
            task = celery.tasks[celery.conf.beat_schedule[name]["task"]]
            try:
                await asyncio.to_thread(task.apply, throw=True)
            except Exception:  # it runs again when next due; one failure must not stop the others
                log.exception("scheduled task %s failed", name)
        await asyncio.sleep(tick_s)
