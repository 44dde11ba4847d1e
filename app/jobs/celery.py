"""Celery: the task queue and the one beat of a deployment.

With PARALON_CELERY_BROKER_URL set (Redis in production), `paralon worker`
runs tasks and `paralon beat` schedules them; without it (the embedded
default) tasks run in-process, at the call. Tasks are acknowledged late and
safe to run twice: everything they write carries an idempotency key. The
invoices' tasks live in `invoices.tasks`; this app runs them and gives them
their database and settings.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from celery import Celery
from celery.schedules import crontab
from sqlalchemy import Engine

from app import wiring
from app import outbox
from app.jobs import low_balance_alerts, payout_mail
from app.jobs.ledger_check import run_verification
from app.limits import (
    LOW_BALANCE_ALERTS_INTERVAL_S,
    OUTBOX_INTERVAL_S,
    READ_MODELS_INTERVAL_S,
    STATEMENTS_DAILY_AT_HOUR,
    STATEMENTS_DAILY_AT_MINUTE,
    STRIPE_PAYOUTS_INTERVAL_S,
    STRIPE_RETRIES_INTERVAL_S,
)
from app.payments import payouts
from app.payments.stripe import process_pending as stripe_process_pending
from app.settings import Settings
from app.statement_labels import statement_labels
from invoices import tasks as invoice_tasks
from ledger.db import make_engine

LOW_BALANCE_ALERTS = "paralon.low_balance_alerts"
PAYOUTS_SEND = "paralon.payouts_send"
PAYOUTS_SEND_STRIPE = "paralon.payouts_send_stripe"
PAYOUT_DESTINATION_CHANGED = payouts.DESTINATION_CHANGED_TASK
WEEKLY_PAYOUTS = "paralon.weekly_payouts"
_settings = Settings.from_env()
broker_url = _settings.celery.broker_url
celery = Celery("paralon", broker=broker_url or "memory://", backend=_settings.celery.result_url)
celery.conf.update(
    task_always_eager=broker_url is None,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "crypto-scan": {
            "task": "paralon.crypto_scan",
            "schedule": _settings.crypto.scan_interval_s,
        },
        "outbox": {"task": "paralon.dispatch_outbox", "schedule": OUTBOX_INTERVAL_S},
        "stripe-retries": {"task": "paralon.stripe_retry_parked", "schedule": STRIPE_RETRIES_INTERVAL_S},
        "stripe-payouts": {"task": PAYOUTS_SEND_STRIPE, "schedule": STRIPE_PAYOUTS_INTERVAL_S},
        "read-models": {"task": invoice_tasks.PROJECT_READ_MODELS, "schedule": READ_MODELS_INTERVAL_S},
        "anchor-ledger": {"task": "paralon.anchor_ledger", "schedule": _settings.anchors.interval_s},
        "ledger-verify": {"task": "paralon.verify_ledger", "schedule": _settings.database.ledger_verify_interval_s},
        "low-balance-alerts": {"task": LOW_BALANCE_ALERTS, "schedule": LOW_BALANCE_ALERTS_INTERVAL_S},
        # Hourly on Mondays, so a beat down at midnight still pays the week; each owner and rail once a week.
        "weekly-payouts": {"task": WEEKLY_PAYOUTS, "schedule": crontab(minute=0, day_of_week="mon")},
        "payouts-send": {"task": PAYOUTS_SEND, "schedule": _settings.payouts.send_interval_s},
        # Daily, after the close grace of a month (invoices.limits.CLOSE_GRACE_S): the 1st issues
        # last month's statements; later days issue only what a missed or failed run left out.
        "monthly-statements": {"task": invoice_tasks.ISSUE_STATEMENTS,
                               "schedule": crontab(minute=STATEMENTS_DAILY_AT_MINUTE, hour=STATEMENTS_DAILY_AT_HOUR)},
    },
)


def send_task(name: str, args: list) -> None:
    """What the outbox sends with: to the broker, or without one, run here and now."""
    if celery.conf.task_always_eager:
        celery.tasks[name].apply(args=args)
    else:
        celery.send_task(name, args=args)


@contextmanager
def _database() -> Iterator[tuple[Engine, Settings]]:
    """(engine, settings) for one task run; the engine's connections close with it."""
    settings = Settings.from_env()
    engine = make_engine(settings.database.url)
    try:
        yield engine, settings
    finally:
        engine.dispose()


@contextmanager
def _invoice_task_resources() -> Iterator[invoice_tasks.TaskResources]:
    with _database() as (engine, settings):
        yield invoice_tasks.TaskResources(engine, wiring.invoice_settings(settings), wiring.mail_settings(settings),
                                        statement_labels)


invoice_tasks.configure(_invoice_task_resources)


@celery.task(name="paralon.crypto_scan")
def crypto_scan() -> dict:
    """One bounded scan of the chain for deposits (a no-op when crypto is not configured)."""
    with _database() as (engine, settings):  # an engine connects only when used
        crypto = wiring.crypto_settings(settings)
        if not (crypto.rpc_url and crypto.tokens):
            return {"skipped": "crypto deposits are not configured"}
        from app.payments.crypto import connect, scan_once  # web3: only where a chain is configured

        report = scan_once(engine, connect(crypto), crypto)
        if report.credited:
            outbox.dispatch(engine, send_task)  # the invoices, now that the credits are committed
        return dataclasses.asdict(report)


@celery.task(name="paralon.stripe_retry_parked")
def stripe_retry_parked() -> int:
    """Parked Stripe events whose next attempt is due, tried again (their backoff is in app/limits.py)."""
    with _database() as (engine, settings):
        retried = stripe_process_pending(engine, wiring.stripe_settings(settings), parked_only=True)
        if retried:
            outbox.dispatch(engine, send_task)
        return len(retried)


@celery.task(name=PAYOUTS_SEND_STRIPE)
def payouts_send_stripe() -> dict:
    """Pay the requested Stripe payouts (a bounded batch per run; skipped when Stripe is not configured)."""
    with _database() as (engine, settings):
        stripe_settings = wiring.stripe_settings(settings)
        if not stripe_settings.secret_key:
            return {"skipped": "Stripe payouts are not configured: PARALON_STRIPE_SECRET_KEY is not set"}
        from app.payments import payout_stripe

        return payout_stripe.send_pending(engine, stripe_settings).as_dict()


@celery.task(name="paralon.dispatch_outbox")
def dispatch_outbox() -> int:
    with _database() as (engine, _):
        return outbox.dispatch(engine, send_task)


@celery.task(name="paralon.anchor_ledger")
def anchor_ledger() -> dict:
    """Write the chain's head outside the database, when it moved since the newest anchor."""
    from app.anchoring.service import NothingToAnchor, write_anchor

    with _database() as (engine, settings):
        try:
            return write_anchor(engine, wiring.anchor_settings(settings), only_if_moved=True)
        except NothingToAnchor as exc:
            return {"skipped": str(exc)}


@celery.task(name="paralon.verify_ledger")
def verify_ledger() -> dict:
    """Prove the ledger from the last proven event; a failure is logged at ERROR and shown by /metrics."""
    with _database() as (engine, settings):
        return run_verification(engine, wiring.anchor_settings(settings).file)


@celery.task(name=PAYOUT_DESTINATION_CHANGED)
def payout_destination_changed(owner_account_id: int, rail: str) -> int:
    """Mail an owner's people that where they are paid on `rail` changed."""
    with _database() as (engine, settings):
        return payout_mail.destination_changed(engine, wiring.mail_settings(settings), owner_account_id, rail)


@celery.task(name=WEEKLY_PAYOUTS)
def weekly_payouts() -> dict:
    """Owners on the weekly schedule: their earnings asked for, once a week per rail; the rails' senders pay them."""
    with _database() as (engine, settings):
        return payouts.pay_weekly(engine, wiring.payout_rules(settings))


@celery.task(name=LOW_BALANCE_ALERTS)
def low_balance_alerts_task() -> dict:
    """Email the customers whose available balance fell below their threshold, once per crossing."""
    with _database() as (engine, settings):
        return low_balance_alerts.run(engine, wiring.mail_settings(settings))


@celery.task(name=PAYOUTS_SEND)
def payouts_send() -> dict:
    """One bounded run of the USDC payouts' sender (skipped, saying why, when the wallet, token or node is not set)."""
    with _database() as (engine, settings):
        chain = wiring.payout_chain_settings(settings)
        if missing := chain.missing():
            return {"skipped": f"USDC payouts are not configured: set {', '.join(missing)}"}
        from app.payments import payout_chain  # web3: only where a wallet is configured

        return dataclasses.asdict(payout_chain.send_once(engine, payout_chain.connect(chain), chain))
