"""Celery: the task queue and the one beat of a deployment.

With PARALON_CELERY_BROKER_URL set (Redis in production), `paralon worker`
runs tasks and `paralon beat` schedules them; without it (the embedded
default) tasks run in-process, at the call. Tasks are acknowledged late and
safe to run twice: everything they write carries an idempotency key.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

from celery import Celery
from celery.schedules import crontab

from app import wiring

CRYPTO_SCAN_INTERVAL_S_DEFAULT = 15.0
OUTBOX_INTERVAL_S = 5.0
READ_MODELS_INTERVAL_S = 5.0
MAIL_RETRY_WAIT_S = 5
MAIL_RETRIES_MAX = 10_000  # keep trying while the mail server is down
STATEMENT_RETRY_WAIT_S = 60
STATEMENT_RETRIES_MAX = 60

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
        "outbox": {"task": "paralon.dispatch_outbox", "schedule": OUTBOX_INTERVAL_S},
        "read-models": {"task": "paralon.project_read_models", "schedule": READ_MODELS_INTERVAL_S},
        # Daily, after the close grace of a month (invoices.statements.CLOSE_GRACE_S): the 1st issues
        # last month's statements; later days issue only what a missed or failed run left out.
        "monthly-statements": {"task": "paralon.issue_statements", "schedule": crontab(minute=30, hour=0)},
    },
)


@celery.task(name="paralon.crypto_scan")
def crypto_scan() -> dict:
    """One bounded scan of the chain for deposits (a no-op when crypto is not configured)."""
    import dataclasses

    from app.payments.crypto import connect, scan_once

    with _database() as (engine, settings):  # an engine connects only when used
        crypto = wiring.crypto_settings(settings)
        if not (crypto.rpc_url and crypto.tokens):
            return {"skipped": "crypto deposits are not configured"}
        return dataclasses.asdict(scan_once(engine, connect(crypto), crypto))


@contextmanager
def _database():
    """(engine, settings) for one task run; the engine's connections close with it."""
    from app.settings import Settings
    from ledger.db import make_engine

    settings = Settings.from_env()
    engine = make_engine(settings.database.url)
    try:
        yield engine, settings
    finally:
        engine.dispose()


@celery.task(name="paralon.dispatch_outbox")
def dispatch_outbox() -> int:
    from app.jobs import outbox

    with _database() as (engine, _):
        return outbox.dispatch(engine)


@celery.task(name="paralon.issue_invoice")
def issue_invoice(source_seq: int) -> str:
    """Invoice a credited top-up, then queue its email."""
    from invoices.service import issue_for_top_up

    with _database() as (engine, settings):
        number = issue_for_top_up(engine, wiring.invoice_settings(settings), source_seq)["number"]
    email_invoice.delay(number)
    return number


@celery.task(name="paralon.issue_credit_note")
def issue_credit_note(source_seq: int, corrected_seq: int) -> str:
    """A credit note for a refund or a lost dispute, then its email."""
    from invoices.service import issue_credit_note as issue

    with _database() as (engine, settings):
        number = issue(engine, wiring.invoice_settings(settings), source_seq, corrected_seq)["number"]
    email_invoice.delay(number)
    return number


@celery.task(name="paralon.email_invoice", bind=True, max_retries=MAIL_RETRIES_MAX)
def email_invoice(self, number: str) -> str:
    import smtplib

    from invoices.mail import send_invoice

    with _database() as (engine, settings):
        try:
            outcome = send_invoice(engine, wiring.mail_settings(settings), number)
        except (OSError, smtplib.SMTPException) as exc:  # the mail server is down: again, later
            if celery.conf.task_always_eager:  # in-process there is no later: `paralon invoices email-pending`
                return f"failed: {exc}"
            raise self.retry(exc=exc, countdown=MAIL_RETRY_WAIT_S) from None
    if outcome == "busy" and not celery.conf.task_always_eager:
        raise self.retry(countdown=MAIL_RETRY_WAIT_S)
    return outcome


@celery.task(name="paralon.project_read_models")
def project_read_models() -> int:
    """Apply new events to the usage and earnings read models (exactly once)."""
    from invoices import read_models

    with _database() as (engine, _):
        return read_models.catch_up(engine)


@celery.task(name="paralon.issue_statements", bind=True, max_retries=STATEMENT_RETRIES_MAX)
def issue_statements(self, month: str | None = None) -> dict:
    """The statements of a closed month (by default the one before this) not
    issued yet: the read models are checked against the ledger first, then one task per account."""
    from sqlalchemy.exc import OperationalError

    from invoices import statements
    from ledger.schema import utc_now

    with _database() as (engine, _):
        try:
            closed = statements.parse_month(month) if month else statements.previous_month(utc_now())
            account_ids = statements.missing_statements(engine, closed)
        except (statements.StatementNotReady, OperationalError) as exc:
            if celery.conf.task_always_eager:  # in-process: the next day's run tries again
                raise
            raise self.retry(exc=exc, countdown=STATEMENT_RETRY_WAIT_S) from None
    queue = (self.request.delivery_info or {}).get("routing_key")  # the children run where their parent ran
    for account_id in account_ids:
        issue_statement.apply_async((account_id, closed.text), queue=queue)
    return {"month": closed.text, "accounts": len(account_ids)}


@celery.task(name="paralon.issue_statement")
def issue_statement(account_id: int, month: str) -> str:
    from app.statement_labels import statement_labels
    from invoices import statements

    with _database() as (engine, settings):
        return statements.issue(engine, wiring.invoice_settings(settings), account_id, statements.parse_month(month), statement_labels,
                                month_reconciled=True)["pdf_path"]
