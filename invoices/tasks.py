"""The invoices' Celery tasks: invoices and credit notes for what the outbox
sends, their emails, the read models, and the monthly statements.

They run on the Celery app of the process (`shared_task`). What they need of
the deployment (an engine, the settings, how statements name keys and
workers) comes from the function that process gives `configure`: `invoices`
reads no configuration and knows nothing of the proxy's tables. Tasks are
acknowledged late and safe to run twice: everything they write carries an
idempotency key or a unique number.
"""
from __future__ import annotations

import logging
import smtplib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from celery import Task, shared_task
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from invoices import read_models, service, statements
from invoices.limits import MAIL_RETRIES_MAX, MAIL_RETRY_WAIT_S, STATEMENT_RETRIES_MAX, STATEMENT_RETRY_WAIT_S
from invoices.files import DocumentUnavailable
from invoices.mail import MailSettings, send_invoice
from invoices.service import InvoiceSettings
from ledger.schema import utc_now

ISSUE_INVOICE = "paralon.issue_invoice"
ISSUE_CREDIT_NOTE = "paralon.issue_credit_note"
EMAIL_INVOICE = "paralon.email_invoice"
PROJECT_READ_MODELS = "paralon.project_read_models"
ISSUE_STATEMENTS = "paralon.issue_statements"
ISSUE_STATEMENT = "paralon.issue_statement"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskResources:
    """What one task run uses."""

    engine: Engine
    invoice_settings: InvoiceSettings
    mail_settings: MailSettings
    statement_labels: statements.LabelLookup


# Opens the resources of one task run; closing it disposes of the engine.
OpenResources = Callable[[], AbstractContextManager[TaskResources]]
_open_resources: OpenResources | None = None


def configure(open_resources: OpenResources) -> None:
    """Called once by the process that runs the tasks, before any runs."""
    global _open_resources
    _open_resources = open_resources


def _resources() -> AbstractContextManager[TaskResources]:
    if _open_resources is None:
        raise RuntimeError("invoices.tasks.configure() was not called: the tasks have no database")
    return _open_resources()


def _in_process(task: Task) -> bool:
    """Without a broker a task runs at the call, where there is no 'later' to retry at."""
    return bool(task.app.conf.task_always_eager)


@shared_task(name=ISSUE_INVOICE, bind=True)
def issue_invoice(self: Task, source_seq: int) -> str:
    """Invoice a credited top-up, then queue its email."""
    with _resources() as r:
        number = service.issue_for_top_up(r.engine, r.invoice_settings, source_seq)["number"]
    self.app.tasks[EMAIL_INVOICE].delay(number)
    return number


@shared_task(name=ISSUE_CREDIT_NOTE, bind=True)
def issue_credit_note(self: Task, source_seq: int, corrected_seq: int) -> str:
    """A credit note for a refund or a lost dispute, then its email."""
    with _resources() as r:
        number = service.issue_credit_note(r.engine, r.invoice_settings, source_seq, corrected_seq)["number"]
    self.app.tasks[EMAIL_INVOICE].delay(number)
    return number


@shared_task(name=EMAIL_INVOICE, bind=True, max_retries=MAIL_RETRIES_MAX)
def email_invoice(self: Task, number: str) -> str:
    with _resources() as r:
        try:
            outcome = send_invoice(r.engine, r.mail_settings, number, r.invoice_settings)
        except DocumentUnavailable as exc:  # retrying cannot help: an operator must restore the file
            log.error("invoice %s was not emailed: %s", number, exc)
            if _in_process(self):
                return f"failed: {exc}"
            raise
        except (OSError, smtplib.SMTPException) as exc:  # the mail server is down: again, later
            if _in_process(self):  # in-process there is no later: `paralon invoices email-pending`
                return f"failed: {exc}"
            raise self.retry(exc=exc, countdown=MAIL_RETRY_WAIT_S) from None
    if outcome == "busy" and not _in_process(self):
        raise self.retry(countdown=MAIL_RETRY_WAIT_S)
    return outcome


@shared_task(name=PROJECT_READ_MODELS)
def project_read_models() -> int:
    """Apply new events to the usage and earnings read models (exactly once); 0 when another
    applier holds the lease (a `paralon serve` replica follows the log itself)."""
    with _resources() as r:
        applied = read_models.catch_up_alone(r.engine)
    if applied is None:
        log.debug("the read models have an applier already; this run skips")
    return applied or 0


@shared_task(name=ISSUE_STATEMENTS, bind=True, max_retries=STATEMENT_RETRIES_MAX)
def issue_statements(self: Task, month: str | None = None) -> dict:
    """The statements of a closed month (by default the one before this) not
    issued yet: the read models are checked against the ledger first, then one task per account."""
    with _resources() as r:
        try:
            closed = statements.parse_month(month) if month else statements.previous_month(utc_now())
            account_ids = statements.missing_statements(r.engine, closed)
        except (statements.StatementNotReady, OperationalError) as exc:
            if _in_process(self):  # in-process: the next day's run tries again
                raise
            raise self.retry(exc=exc, countdown=STATEMENT_RETRY_WAIT_S) from None
    queue = (self.request.delivery_info or {}).get("routing_key")  # the children run where their parent ran
    for account_id in account_ids:
        self.app.tasks[ISSUE_STATEMENT].apply_async((account_id, closed.text), queue=queue)
    return {"month": closed.text, "accounts": len(account_ids)}


@shared_task(name=ISSUE_STATEMENT)
def issue_statement(account_id: int, month: str) -> str:
    with _resources() as r:
        return statements.issue(r.engine, r.invoice_settings, account_id, statements.parse_month(month), r.statement_labels,
                                month_reconciled=True)["pdf_path"]
