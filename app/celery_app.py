"""Celery: the task queue and the one beat of a deployment.

With PARALON_CELERY_BROKER_URL set (Redis in production), `paralon worker`
runs tasks and `paralon beat` schedules them; without it (the embedded
default) tasks run in-process, at the call. Tasks are acknowledged late and
safe to run twice: everything they write carries an idempotency key.
"""
from __future__ import annotations

import os

from celery import Celery

CRYPTO_SCAN_INTERVAL_S_DEFAULT = 15.0

broker_url = os.environ.get("PARALON_CELERY_BROKER_URL") or None
celery = Celery("paralon", broker=broker_url or "memory://", backend=os.environ.get("PARALON_CELERY_RESULT_URL") or None)
celery.conf.update(
    task_always_eager=broker_url is None,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "crypto-scan": {
            "task": "paralon.crypto_scan",
            "schedule": float(os.environ.get("PARALON_CRYPTO_SCAN_INTERVAL_S") or CRYPTO_SCAN_INTERVAL_S_DEFAULT),
        },
    },
)


@celery.task(name="paralon.crypto_scan")
def crypto_scan() -> dict:
    """One bounded scan of the chain for deposits (a no-op when crypto is not configured)."""
    import dataclasses

    from app.crypto_deposits import connect, scan_once
    from app.settings import Settings
    from ledger.db import make_engine

    settings = Settings.from_env()
    crypto = settings.crypto()
    if not (crypto.rpc_url and crypto.tokens):
        return {"skipped": "crypto deposits are not configured"}
    engine = make_engine(settings.database_url)
    try:
        return dataclasses.asdict(scan_once(engine, connect(crypto), crypto))
    finally:
        engine.dispose()
