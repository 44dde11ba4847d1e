"""Invoices by email: a real SMTP server (aiosmtpd) receives the mail and its
PDF; with the server down then up, a real Celery worker on the local Redis
sends each invoice exactly once."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from email import message_from_bytes, policy

import pytest
from aiosmtpd.controller import Controller

from invoices.mail import MailSettings, send_invoice
from invoices.service import InvoiceSettings, issue_for_top_up
from ledger import commands as cmd
from ledger.service import append_now
from tests.support.harness import free_port, make_fleet, wait_for


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
        assert send_invoice(fleet.engine, settings, invoice["number"]) == "sent"
        assert send_invoice(fleet.engine, settings, invoice["number"]) == "already sent"
    finally:
        server.stop()
    assert len(inbox.messages) == 1
    message = inbox.messages[0]
    assert message["To"] == "customer@example.com" and invoice["number"] in message["Subject"]
    attachment = next(message.iter_attachments())
    assert attachment.get_filename() == f"{invoice['number']}.pdf"
    assert attachment.get_content() == open(invoice["pdf_path"], "rb").read()


def test_smtp_down_then_up_sends_each_invoice_exactly_once(fleet, tmp_path, redis_url):
    numbers = [issue_for_top_up(fleet.engine, InvoiceSettings(tmp_path), _top_up(fleet, f"t{i}"))["number"] for i in range(3)]
    port, queue = free_port(), f"paralon-test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PARALON_DATABASE_URL": fleet.database_url, "PARALON_CELERY_BROKER_URL": redis_url,
           "PARALON_SMTP_HOST": "127.0.0.1", "PARALON_SMTP_PORT": str(port), "PARALON_INVOICE_DIR": str(tmp_path)}
    worker = subprocess.Popen([sys.executable, "-c", "from app.cli import main; main()", "worker", "-Q", queue,
                               "--concurrency", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    inbox = Inbox()
    server = None
    try:
        from celery import Celery

        client = Celery(broker=redis_url)
        for number in numbers + numbers[:1]:  # one of them queued twice
            client.send_task("paralon.email_invoice", args=[number], queue=queue)
        time.sleep(3)  # the mail server is down: every attempt fails and is retried
        assert inbox.messages == []
        server = _smtp(port, inbox)
        wait_for(lambda: len(inbox.messages) >= 3, timeout_s=60)
        time.sleep(6)  # time for any duplicate to arrive
    finally:
        worker.terminate()
        worker.wait(20)
        if server is not None:
            server.stop()
    subjects = sorted(m["Subject"] for m in inbox.messages)
    assert len(subjects) == 3 and all(any(n in s for s in subjects) for n in numbers), subjects
