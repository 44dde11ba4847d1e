"""Sending an invoice by email, with its PDF attached, once.

A sender first claims the invoice (so two workers never send it together),
sends, then records `emailed_at`; a failed send releases nothing and raises,
and the task is retried while the mail server is down. The Message-ID is
derived from the invoice number, so even a send repeated after a crash
between sending and recording is one message to a mail client. The PDF
attached is only ever the one whose SHA-256 the ledger recorded: a stored file
that is not it is rendered again or, failing that, nothing is sent
(`DocumentUnavailable`), never another document."""
from __future__ import annotations

import smtplib
from dataclasses import dataclass, field
from datetime import timedelta
from email.message import EmailMessage

from sqlalchemy import Engine, or_, select, update

from invoices.limits import MAIL_CLAIM_TIMEOUT_S, SMTP_PORT_DEFAULT, SMTP_TIMEOUT_S
from invoices.render import cents_text
from invoices.schema import invoices
from invoices.service import InvoiceSettings, invoice_pdf
from ledger.schema import accounts, utc_now


@dataclass(frozen=True)
class MailSettings:
    host: str | None
    port: int = SMTP_PORT_DEFAULT
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # secrets stay out of reprs and logs
    sender: str = "billing@paralon.example"


def send_invoice(engine: Engine, settings: MailSettings, number: str, documents: InvoiceSettings) -> str:
    """'sent', 'already sent', 'no address', 'busy' (another sender holds it), or 'not configured';
    raises `DocumentUnavailable` (nothing sent, claim released) when the recorded PDF cannot be had."""
    if not settings.host:
        return "not configured"
    now = utc_now()
    with engine.begin() as conn:
        claimed = conn.execute(
            update(invoices).where(invoices.c.number == number, invoices.c.emailed_at.is_(None), invoices.c.pdf_path.is_not(None),
                                   or_(invoices.c.email_claimed_at.is_(None),
                                       invoices.c.email_claimed_at < now - timedelta(seconds=MAIL_CLAIM_TIMEOUT_S)))
            .values(email_claimed_at=now)
        ).rowcount
        invoice = conn.execute(select(invoices).where(invoices.c.number == number)).one()
        to = conn.execute(select(accounts.c.email).where(accounts.c.id == invoice.account_id)).scalar()
    if invoice.emailed_at is not None:
        return "already sent"
    if not claimed:
        return "busy"
    if not to:
        return "no address"
    try:
        send_message(settings, _message(settings, invoice, to, invoice_pdf(engine, documents, number)))
    except BaseException:
        with engine.begin() as conn:  # let the retry claim it again at once
            conn.execute(update(invoices).where(invoices.c.number == number).values(email_claimed_at=None))
        raise
    with engine.begin() as conn:
        conn.execute(update(invoices).where(invoices.c.number == number).values(emailed_at=utc_now()))
    return "sent"


def _message(settings: MailSettings, invoice, to: str, pdf: bytes) -> EmailMessage:
    title = "Credit note" if invoice.kind == "credit_note" else "Invoice"
    message = EmailMessage()
    message["From"], message["To"] = settings.sender, to
    message["Subject"] = f"Paralon {title.lower()} {invoice.number}: {cents_text(invoice.amount_nano_usd)} USD"
    message["Message-ID"] = f"<{invoice.number}@{settings.sender.split('@')[-1]}>"
    message.set_content(f"{title} {invoice.number} for {cents_text(invoice.amount_nano_usd)} USD is attached.\n\nThank you.\n")
    message.add_attachment(pdf, maintype="application", subtype="pdf",
                           filename=f"{invoice.number}.pdf")
    return message


def send_message(settings: MailSettings, message: EmailMessage) -> None:
    """One message through the configured SMTP server (STARTTLS and a login when a user is set)."""
    with smtplib.SMTP(settings.host, settings.port, timeout=SMTP_TIMEOUT_S) as smtp:
        if settings.user:
            smtp.starttls()
            smtp.login(settings.user, settings.password or "")
        smtp.send_message(message)
