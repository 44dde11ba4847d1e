"""The invoices' Celery tasks on a Celery app of the test's own, run in-process:
`invoices` brings its tasks, whoever runs them brings the database and the
settings. (A real worker runs them in test_mail.py and test_statements.py.)"""
from __future__ import annotations

from contextlib import contextmanager

import grimp
import pytest
from celery import Celery

from invoices import read_models, tasks
from invoices.mail import MailSettings
from invoices.service import InvoiceSettings, list_invoices
from invoices.statements import Labels
from ledger import commands as cmd
from ledger.service import append_now
from tests.support.harness import free_port, make_fleet


@pytest.fixture
def fleet(database_url):
    fleet = make_fleet(database_url, [], credits_usd="0")
    yield fleet
    fleet.engine.dispose()


@pytest.fixture
def in_process(fleet, tmp_path):
    """An eager Celery app whose task runs use the test's database; the tasks' wiring is restored after."""
    app = Celery("invoices-test", set_as_current=False, broker="memory://")
    app.conf.task_always_eager = True
    mail = MailSettings("127.0.0.1", free_port())  # nothing listens there: the mail server is down

    @contextmanager
    def resources():
        yield tasks.TaskResources(fleet.engine, InvoiceSettings(tmp_path), mail, lambda conn, account_id: Labels())

    before = tasks._open_resources
    tasks.configure(resources)
    yield app
    tasks.configure(before)


def test_a_credited_top_up_is_invoiced_and_its_email_tried(fleet, in_process):
    seq = append_now(fleet.engine, cmd.PurchaseCredits(fleet.customer_id, 2_500_000_000, "card", "stripe:t1", "external:stripe", "t1")).seq
    number = in_process.tasks[tasks.ISSUE_INVOICE].apply(args=[seq], throw=True).get()
    assert [i["number"] for i in list_invoices(fleet.engine, fleet.customer_id)] == [number]
    emailed = in_process.tasks[tasks.EMAIL_INVOICE].apply(args=[number], throw=True).get()
    assert emailed.startswith("failed: "), "in-process there is no later to retry at: `paralon invoices email-pending` is"


def test_the_read_models_task_applies_new_events_once(fleet, in_process):
    append_now(fleet.engine, cmd.GrantCredits(fleet.customer_id, 1_000_000_000, "welcome", "grant-1"))
    assert in_process.tasks[tasks.PROJECT_READ_MODELS].apply(throw=True).get() >= 1
    assert read_models.lag_events(fleet.engine) == 0
    assert in_process.tasks[tasks.PROJECT_READ_MODELS].apply(throw=True).get() == 0, "nothing twice"


def test_a_task_run_without_configuration_says_so(in_process):
    tasks.configure(None)
    with pytest.raises(RuntimeError, match="configure"):
        in_process.tasks[tasks.PROJECT_READ_MODELS].apply(throw=True)


def test_the_tasks_import_nothing_of_app():
    graph = grimp.build_graph("app", "invoices", "ledger", "proxy", cache_dir=None)
    assert not {m for m in graph.find_upstream_modules("invoices.tasks") if not m.startswith(("invoices", "ledger"))}
