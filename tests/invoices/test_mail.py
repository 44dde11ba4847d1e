"""Invoices by email: a real SMTP server (aiosmtpd) receives the mail and its
PDF; with the server down then up, a real Celery worker on the local Redis
sends each invoice exactly once."""
from __future__ import annotations

from email import message_from_bytes, policy

import pytest
from aiosmtpd.controller import Controller

from invoices.mail import MailSettings, send_invoice
from invoices.service import InvoiceSettings, issue_for_top_up
from invoices.tasks import EMAIL_INVOICE
from ledger import commands as cmd
from ledger.service import append_now
from tests.support.celery_worker import celery_worker  # noqa: F401 (a fixture)
from tests.support.harness import free_port, make_fleet


class Inbox:
    def __init__(self) -> None:
        self.messages = []

    async def handle_DATA(self, server, session, envelope):
        self.messages.append(message_from_bytes(envelope.content, policy=policy.default))
        return "250 OK"


def _smtp(port: int, inbox: Inbox) -> Controller:
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    return controller


@pytest.fixture
def fleet(database_url):
    fleet = make_fleet(database_url, [], credits_usd="0")
    yield fleet
    fleet.engine.dispose()


def _top_up(fleet, key: str) -> int:
    return append_now(fleet.engine, cmd.PurchaseCredits(fleet.customer_id, 2_500_000_000, "card", f"stripe:{key}",
                                                        "external:stripe", key)).seq


def test_the_invoice_arrives_by_smtp_with_its_pdf_once(fleet, tmp_path):
    inbox, port = Inbox(), free_port()
    server = _smtp(port, inbox)
    try:
        invoice = issue_for_top_up(fleet.engine, InvoiceSettings(tmp_path), _top_up(fleet, "t1"))
        settings = MailSettings("127.0.0.1", port)
        assert send_invoice(fleet.engine, settings, invoice["number"], InvoiceSettings(tmp_path)) == "sent"
        assert send_invoice(fleet.engine, settings, invoice["number"], InvoiceSettings(tmp_path)) == "already sent"
    finally:
        server.stop()
    assert len(inbox.messages) == 1
    message = inbox.messages[0]
    assert message["To"] == "customer@example.com" and invoice["number"] in message["Subject"]
    attachment = next(message.iter_attachments())
    assert attachment.get_filename() == f"{invoice['number']}.pdf"
    assert attachment.get_content() == open(invoice["pdf_path"], "rb").read()


def test_smtp_down_then_up_sends_each_invoice_exactly_once(fleet, tmp_path, celery_worker):
    numbers = [issue_for_top_up(fleet.engine, InvoiceSettings(tmp_path), _top_up(fleet, f"t{i}"))["number"] for i in range(3)]
    port, inbox = free_port(), Inbox()
    worker = celery_worker({"PARALON_DATABASE_URL": fleet.database_url, "PARALON_SMTP_HOST": "127.0.0.1",
                            "PARALON_SMTP_PORT": str(port), "PARALON_INVOICE_DIR": str(tmp_path)})
    sent = [worker.send(EMAIL_INVOICE, number) for number in numbers + numbers[:1]]  # one of them queued twice
    worker.wait_for_states(sent, "RETRY")  # the mail server is down: every attempt failed and is to be retried
    assert inbox.messages == []
    server = _smtp(port, inbox)
    try:
        outcomes = [worker.result(one) for one in sent]  # every task has finished: nothing more can arrive
    finally:
        server.stop()
    assert sorted(outcomes) == ["already sent", "sent", "sent", "sent"], outcomes
    subjects = sorted(m["Subject"] for m in inbox.messages)
    assert len(subjects) == 3 and all(any(n in s for s in subjects) for n in numbers), subjects
