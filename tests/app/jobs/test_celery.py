"""The deployment's Celery app: its beat schedule, the embedded beat of `paralon up`,
and the invoices' tasks run with the database and settings it gives them."""
from __future__ import annotations

from app import outbox
from app.jobs.celery import celery
from app.jobs.embedded_beat import NEVER, due_tasks
from invoices.service import list_invoices
from invoices.tasks import ISSUE_INVOICE, ISSUE_STATEMENTS
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.service import append_now


def test_the_monthly_statements_run_daily_after_midnight():
    schedule = celery.conf.beat_schedule["monthly-statements"]
    assert schedule["task"] == ISSUE_STATEMENTS
    assert (schedule["schedule"].hour, schedule["schedule"].minute) == ({0}, {30}), "daily, so a missed 1st is made up"
    assert len(schedule["schedule"].day_of_month) == 31


def test_every_scheduled_task_is_registered_and_the_embedded_beat_runs_each_at_start():
    assert {entry["task"] for entry in celery.conf.beat_schedule.values()} <= set(celery.tasks)
    last_run_at = {name: NEVER for name in celery.conf.beat_schedule}
    assert sorted(due_tasks(last_run_at)) == sorted(celery.conf.beat_schedule), "what a stopped laptop missed"
    assert due_tasks(last_run_at) == [], "then each when it is due"


def test_without_a_broker_the_outbox_runs_the_invoice_task_here_with_the_configured_database(engine, database_url, monkeypatch):
    monkeypatch.setitem(celery.conf, "task_always_eager", True)  # the embedded default, whatever this environment sets
    monkeypatch.setenv("PARALON_DATABASE_URL", database_url)
    with engine.begin() as conn:
        customer = acc.create_account(conn, cmd.CUSTOMER, "Ada", "ada@example.com")
    seq = append_now(engine, cmd.PurchaseCredits(customer, 2_500_000_000, "card", "stripe:s1", "external:stripe", "s1")).seq
    with engine.begin() as conn:
        outbox.add(conn, ISSUE_INVOICE, seq)
    assert celery.tasks["paralon.dispatch_outbox"].apply(throw=True).get() == 1
    assert [(i["source_seq"], bool(i["pdf_sha256"])) for i in list_invoices(engine, customer)] == [(seq, True)]
