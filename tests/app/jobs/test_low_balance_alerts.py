"""Low-balance alerts through a real SMTP server (aiosmtpd): one email when the
available balance falls below the customer's threshold, none while it stays
there, another only after a top-up brought it back and it fell again; two runs
at once send one; a mail server away sends nothing, marks nothing, and the
next run sends."""
from __future__ import annotations

import threading
import time
from email import message_from_bytes, policy

import pytest
from aiosmtpd.controller import Controller
from sqlalchemy import select

from app import low_balance
from app.jobs import low_balance_alerts as alerts
from app.jobs.celery import LOW_BALANCE_ALERTS, celery
from invoices.mail import MailSettings
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.errors import InvalidAmount, WrongAccountKind
from ledger.holds import PlaceHold
from ledger.money import usd_to_nano_usd
from ledger.schema import accounts
from ledger.service import Ledger, append_now
from tests.ledger.helpers import money_snapshot
from tests.support.harness import free_port, make_fleet

SMTP_SLOW_S = 0.5  # each message waits this long in the server: a second run meets the first one's claim


class Inbox:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.messages = []
        self.delay_s = delay_s

    async def handle_DATA(self, server, session, envelope):
        if self.delay_s:
            time.sleep(self.delay_s)  # holds the whole server: the sender stays inside its claim
        self.messages.append(message_from_bytes(envelope.content, policy=policy.default))
        return "250 OK"


@pytest.fixture
def fleet(database_url):
    fleet = make_fleet(database_url, [], credits_usd="10")
    yield fleet
    fleet.engine.dispose()


@pytest.fixture
def smtp():
    inbox, port = Inbox(), free_port()
    server = Controller(inbox, hostname="127.0.0.1", port=port)
    server.start()
    yield inbox, MailSettings("127.0.0.1", port)
    server.stop()


def _set(fleet, account_id: int, usd: str | None) -> None:
    with fleet.engine.begin() as conn:
        low_balance.set_alert(conn, account_id, usd)


def _adjust(fleet, usd: str, key: str) -> None:
    append_now(fleet.engine, cmd.AdjustBalance(fleet.customer_id, usd_to_nano_usd(usd), "test spend", key))


def test_a_fall_below_alerts_once_and_a_top_up_rearms_it(fleet, smtp):
    inbox, mail = smtp
    _set(fleet, fleet.customer_id, "5.00")
    assert alerts.run(fleet.engine, mail)["sent"] == 0, "$10 is above $5"

    _adjust(fleet, "-6", "spend-1")  # $4 left
    assert alerts.run(fleet.engine, mail) == {"sent": 1, "rearmed": 0, "skipped": 0, "failed": 0}
    [message] = inbox.messages
    assert message["To"] == "customer@example.com" and "below 5.00 USD" in message["Subject"]
    assert "is 4.00 USD, below the 5.00 USD" in message.get_content()
    assert alerts.run(fleet.engine, mail)["sent"] == 0 and len(inbox.messages) == 1, "still below: no second email"

    append_now(fleet.engine, cmd.PurchaseCredits(fleet.customer_id, usd_to_nano_usd("3"), "card", "stripe:t1", "external:stripe", "t1"))
    assert alerts.run(fleet.engine, mail) == {"sent": 0, "rearmed": 1, "skipped": 0, "failed": 0}, "$7: back above"
    assert len(inbox.messages) == 1

    ledger = Ledger(fleet.engine)  # a request in flight: its hold counts against the available balance
    try:
        ledger.place_hold(PlaceHold(fleet.customer_id, usd_to_nano_usd("2.5"), "hold-1"))
    finally:
        ledger.close()
    assert alerts.run(fleet.engine, mail)["sent"] == 1, "$4.50 available: the next fall below alerts again"
    assert "is 4.50 USD" in inbox.messages[-1].get_content() and len(inbox.messages) == 2


def test_no_alert_without_a_threshold_or_after_it_is_turned_off(fleet, smtp):
    inbox, mail = smtp
    _adjust(fleet, "-9.5", "spend-1")
    assert alerts.run(fleet.engine, mail)["sent"] == 0
    _set(fleet, fleet.customer_id, "1.00")
    _set(fleet, fleet.customer_id, None)
    assert alerts.run(fleet.engine, mail)["sent"] == 0 and inbox.messages == []


def test_two_runs_at_once_send_one_email_per_account(fleet, smtp):
    inbox, mail = smtp
    inbox.delay_s = SMTP_SLOW_S
    with fleet.engine.begin() as conn:
        others = [acc.create_account(conn, cmd.CUSTOMER, f"customer {n}", f"c{n}@example.com") for n in range(3)]
    for account_id in (fleet.customer_id, *others):
        _set(fleet, account_id, "2.00")  # the others have nothing: below at once
    _adjust(fleet, "-9", "spend-1")
    start, reports = threading.Barrier(2), []

    def one_run() -> None:
        start.wait()
        reports.append(alerts.run(fleet.engine, mail))

    runs = [threading.Thread(target=one_run) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(60)
    assert sum(r["sent"] for r in reports) == 4 and sum(r["failed"] for r in reports) == 0, reports
    assert sum(r["skipped"] for r in reports) >= 1, f"the runs met on some account: {reports}"
    assert sorted(m["To"] for m in inbox.messages) == sorted(["customer@example.com", *(f"c{n}@example.com" for n in range(3))])


def test_a_mail_server_away_sends_and_marks_nothing_and_the_next_run_sends(fleet):
    port = free_port()
    _set(fleet, fleet.customer_id, "5.00")
    _adjust(fleet, "-6", "spend-1")
    assert alerts.run(fleet.engine, MailSettings("127.0.0.1", port))["failed"] == 1
    with fleet.engine.connect() as conn:
        marks = conn.execute(select(accounts.c.low_balance_alerted_at, accounts.c.low_balance_alert_claimed_at)
                             .where(accounts.c.id == fleet.customer_id)).one()
    assert tuple(marks) == (None, None), "the claim is released: the next run may send"
    inbox = Inbox()
    server = Controller(inbox, hostname="127.0.0.1", port=port)
    server.start()
    try:
        assert alerts.run(fleet.engine, MailSettings("127.0.0.1", port))["sent"] == 1
    finally:
        server.stop()
    assert len(inbox.messages) == 1


def test_the_task_runs_every_minute_with_the_smtp_settings_invoices_use(fleet, smtp, monkeypatch):
    inbox, mail = smtp
    assert celery.conf.beat_schedule["low-balance-alerts"] == {"task": LOW_BALANCE_ALERTS, "schedule": 60.0}
    monkeypatch.setitem(celery.conf, "task_always_eager", True)
    monkeypatch.setenv("PARALON_DATABASE_URL", fleet.database_url)
    monkeypatch.setenv("PARALON_SMTP_HOST", mail.host)
    monkeypatch.setenv("PARALON_SMTP_PORT", str(mail.port))
    _set(fleet, fleet.customer_id, "20.00")
    assert celery.tasks[LOW_BALANCE_ALERTS].apply(throw=True).get()["sent"] == 1
    assert [m["To"] for m in inbox.messages] == ["customer@example.com"]


def test_bad_thresholds_are_refused_and_write_nothing(fleet):
    with fleet.engine.begin() as conn:
        owner = acc.create_account(conn, cmd.OWNER, "GPU farm")
    _set(fleet, fleet.customer_id, "3.00")
    before = money_snapshot(fleet.engine)
    for bad in ("-1", "-0.01", "0", "0.00", "2.001", "1e3", " 2", "2.", "+2", "", "two", 2, 2.5, True, ["2"], {"usd": "2"}):
        with fleet.engine.begin() as conn, pytest.raises(InvalidAmount):
            low_balance.set_alert(conn, fleet.customer_id, bad)
    with fleet.engine.begin() as conn, pytest.raises(WrongAccountKind):
        low_balance.set_alert(conn, owner, "2.00")
    with fleet.engine.connect() as conn:
        assert low_balance.alert_view(conn, fleet.customer_id)["threshold_usd"] == "3.00"
        assert conn.execute(select(accounts.c.low_balance_threshold_nano_usd).where(accounts.c.id == owner)).scalar() is None
    assert money_snapshot(fleet.engine) == before
