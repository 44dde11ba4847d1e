"""Issuing an invoice for a credited top-up: number, PDF, file, ledger record.

Each step can be run again after a crash and picks up where it stopped: the
number is assigned once per top-up (unique on its ledger event), the PDF is
rendered from the database alone (a retry renders the same bytes), its file is
named by deployment and content (invoices/files.py), and the `InvoiceIssued`
event carries an idempotency key per number; the SHA-256 it records is the
one every later download and email is checked against.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson
from sqlalchemy import Engine, select, update
from sqlalchemy.exc import IntegrityError

from invoices import numbering
from invoices.files import deployment_id, read_if_recorded, recorded_document, sha256, write_whole
from invoices.limits import INVOICE_FILE_DIGEST_CHARS, NUMBER_ASSIGN_ATTEMPTS_MAX
from invoices.render import render_pdf
from invoices.schema import invoices
from ledger import commands as cmd
from ledger.errors import InvalidInput
from ledger.limits import REASON_CHARS_MAX
from ledger.schema import accounts, ledger_events, utc_now
from ledger.service import append_now


@dataclass(frozen=True)
class InvoiceSettings:
    storage_dir: Path
    seller_name: str = "Paralon"
    seller_address: str = "ParalonCloud, online"
    seller_email: str = "billing@paralon.example"


def issue_for_top_up(engine: Engine, settings: InvoiceSettings, source_seq: int) -> dict:
    """The invoice of the `CreditsPurchased` event `source_seq` (issued now, or as it was)."""
    with engine.connect() as conn:
        event = conn.execute(select(ledger_events.c.event_type, ledger_events.c.payload).where(ledger_events.c.seq == source_seq)).first()
    if event is None or event.event_type != "CreditsPurchased":
        raise InvalidInput(f"event {source_seq} is not a credited top-up")
    payload = orjson.loads(event.payload)
    row = {"kind": "invoice", "account_id": payload["account_id"], "amount_nano_usd": payload["amount_nano_usd"],
           "payment_method": payload["payment_method"], "external_reference": payload["external_reference"][:REASON_CHARS_MAX],
           "issued_at": utc_now()}
    number = _assign(engine, numbering.SERIES_INVOICE, row["issued_at"].year, source_seq, row)
    return _finish(engine, settings, number)


CREDIT_NOTE_EVENTS = ("CreditsRefunded", "FrozenCreditsForfeited")


def issue_credit_note(engine: Engine, settings: InvoiceSettings, source_seq: int, corrected_seq: int) -> dict:
    """The credit note for a refund or a lost dispute (`source_seq`), in its own
    series, referring to the invoice of the top-up it corrects (`corrected_seq`)."""
    with engine.connect() as conn:
        event = conn.execute(select(ledger_events.c.event_type, ledger_events.c.payload).where(ledger_events.c.seq == source_seq)).first()
    if event is None or event.event_type not in CREDIT_NOTE_EVENTS:
        raise InvalidInput(f"event {source_seq} is not a refund or a lost dispute")
    corrected = issue_for_top_up(engine, settings, corrected_seq)
    payload = orjson.loads(event.payload)
    row = {"kind": "credit_note", "account_id": payload["account_id"], "amount_nano_usd": payload["amount_nano_usd"],
           "payment_method": payload.get("payment_method", "card"), "external_reference": payload["external_reference"][:REASON_CHARS_MAX],
           "issued_at": utc_now(), "corrects_number": corrected["number"]}
    number = _assign(engine, numbering.SERIES_CREDIT_NOTE, row["issued_at"].year, source_seq, row)
    return _finish(engine, settings, number)


def _assign(engine: Engine, series: str, year: int, source_seq: int, row: dict) -> str:
    for attempt in range(1, NUMBER_ASSIGN_ATTEMPTS_MAX + 1):
        try:
            with engine.begin() as conn:
                return numbering.assign(conn, series, year, source_seq, row).number
        except IntegrityError:  # a concurrent first number of the year, or of this very top-up: look again
            if attempt == NUMBER_ASSIGN_ATTEMPTS_MAX:
                raise
    raise AssertionError("unreachable")


def _finish(engine: Engine, settings: InvoiceSettings, number: str) -> dict:
    with engine.connect() as conn:
        invoice = conn.execute(select(invoices).where(invoices.c.number == number)).one()
        buyer = conn.execute(select(accounts.c.name, accounts.c.email).where(accounts.c.id == invoice.account_id)).one()
        deployment = deployment_id(conn)
    if invoice.issued_event_seq is not None:
        return _view(invoice)
    pdf = render_pdf(_document(settings, invoice, buyer))
    digest = sha256(pdf)
    path = invoice_path(settings, deployment, invoice, digest)
    if read_if_recorded(path, digest) is None:  # a file of another content is never kept under this name
        write_whole(path, pdf)
    recorded = append_now(engine, cmd.RecordInvoice(number, invoice.kind, invoice.source_seq, invoice.account_id,
                                                    invoice.amount_nano_usd, digest.hex(), f"invoice:{number}"))
    recorded_digest = _recorded_sha256(engine, recorded.seq)
    if recorded_digest != digest:  # an earlier run recorded its own rendering, then stopped: that one stands
        path = invoice_path(settings, deployment, invoice, recorded_digest)
        recorded_document(path, recorded_digest, lambda: pdf, path, f"invoice {number}")
    with engine.begin() as conn:
        conn.execute(update(invoices).where(invoices.c.number == number)
                     .values(pdf_path=str(path), pdf_sha256=recorded_digest, issued_event_seq=recorded.seq))
        invoice = conn.execute(select(invoices).where(invoices.c.number == number)).one()
    return _view(invoice)


def invoice_path(settings: InvoiceSettings, deployment: str, invoice, digest: bytes) -> Path:
    """Unique per deployment and per content: `<dir>/<deployment id>/YYYY/NUMBER-<SHA-256 prefix>.pdf`."""
    return settings.storage_dir / deployment / str(invoice.year) / f"{invoice.number}-{digest.hex()[:INVOICE_FILE_DIGEST_CHARS]}.pdf"


def _document(settings: InvoiceSettings, invoice, buyer) -> dict:
    """What the PDF shows, all from the database: the same row renders the same bytes."""
    return {
        "number": invoice.number, "kind": invoice.kind, "issued_on": invoice.issued_at.date().isoformat(),
        "issued_at": invoice.issued_at.isoformat(), "source_seq": invoice.source_seq, "corrects": invoice.corrects_number,
        "seller": {"name": settings.seller_name, "address": settings.seller_address, "email": settings.seller_email},
        "buyer": {"name": buyer.name, "email": buyer.email, "account_id": invoice.account_id},
        "line": "Inference credits, prepaid" if invoice.kind == "invoice" else "Prepaid credits returned to the payer",
        "amount_nano_usd": invoice.amount_nano_usd,
        "payment_method": invoice.payment_method, "reference": invoice.external_reference,
    }


def _recorded_sha256(engine: Engine, issued_event_seq: int) -> bytes:
    """The PDF's SHA-256 as the `InvoiceIssued` event on the chain holds it."""
    with engine.connect() as conn:
        payload = conn.execute(select(ledger_events.c.payload).where(ledger_events.c.seq == issued_event_seq)).scalar_one()
    return bytes.fromhex(orjson.loads(payload)["pdf_sha256"])


def invoice_pdf(engine: Engine, settings: InvoiceSettings, number: str) -> bytes:
    """The issued document's PDF, for a download or an email: only bytes whose
    SHA-256 is the one the ledger recorded (read, or rendered again), else `DocumentUnavailable`."""
    with engine.connect() as conn:
        invoice = conn.execute(select(invoices).where(invoices.c.number == number)).first()
        if invoice is None or invoice.issued_event_seq is None:
            raise InvalidInput(f"invoice {number} has not been issued")
        buyer = conn.execute(select(accounts.c.name, accounts.c.email).where(accounts.c.id == invoice.account_id)).one()
        deployment = deployment_id(conn)
    recorded = _recorded_sha256(engine, invoice.issued_event_seq)
    content, stored_at = recorded_document(
        Path(invoice.pdf_path), recorded, lambda: render_pdf(_document(settings, invoice, buyer)),
        invoice_path(settings, deployment, invoice, recorded), f"{invoice.kind.replace('_', ' ')} {number}")
    if str(stored_at) != invoice.pdf_path:  # rendered again: the row names the good copy from now on
        with engine.begin() as conn:
            conn.execute(update(invoices).where(invoices.c.number == number).values(pdf_path=str(stored_at)))
    return content


def _view(invoice) -> dict:
    return {"number": invoice.number, "kind": invoice.kind, "account_id": invoice.account_id, "corrects": invoice.corrects_number,
            "amount_nano_usd": invoice.amount_nano_usd, "source_seq": invoice.source_seq,
            "issued_at": invoice.issued_at.isoformat(), "pdf_path": invoice.pdf_path,
            "pdf_sha256": invoice.pdf_sha256.hex() if invoice.pdf_sha256 else None}


def list_invoices(engine: Engine, account_id: int) -> list[dict]:
    with engine.connect() as conn:
        rows = conn.execute(select(invoices).where(invoices.c.account_id == account_id).order_by(invoices.c.issued_at, invoices.c.number)).all()
    return [_view(r) for r in rows]
