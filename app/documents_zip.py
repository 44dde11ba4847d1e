"""A period's documents of one account in one zip, for its accountant: every
invoice and credit note issued in [start, end), the stored statement of every
month inside the period, and `manifest.csv` (name, kind, amount, SHA-256).

Each PDF is taken only with the bytes whose SHA-256 was recorded (read, or
rendered again: invoices/files.py). A document that cannot be had fails the
whole zip with `DocumentUnavailable`; the zip is built in memory, up to a
bound, before anything is sent, so no caller ever gets a partial one."""
from __future__ import annotations

import csv
import hashlib
import io
import zipfile
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine

from app import accounts
from app.limits import DOCUMENTS_ZIP_BYTES_MAX
from app.statement_labels import statement_labels
from invoices import service, statements
from invoices.files import DocumentUnavailable
from invoices.service import InvoiceSettings
from ledger.errors import InvalidInput

MANIFEST_NAME = "manifest.csv"
MANIFEST_COLUMNS = ("name", "kind", "amount_nano_usd", "sha256")
STATEMENT_KIND = "statement"
FOLDER_OF_KIND = {"invoice": "invoices", "credit_note": "credit_notes", STATEMENT_KIND: "statements"}


@dataclass(frozen=True)
class DocumentsZip:
    content: bytes
    manifest: list[dict]  # one row per PDF, as manifest.csv has it


class _Bounded:
    """The zip being written, refusing to grow past `bytes_max` of documents."""

    def __init__(self, bytes_max: int) -> None:
        self.buffer, self.bytes_max, self.document_bytes = io.BytesIO(), bytes_max, 0
        self.archive = zipfile.ZipFile(self.buffer, "w", zipfile.ZIP_DEFLATED)
        self.manifest: list[dict] = []

    def add(self, name: str, kind: str, amount_nano_usd: int, issued_at: datetime, content: bytes) -> None:
        self.document_bytes += len(content)
        if self.document_bytes > self.bytes_max:
            raise InvalidInput(f"the documents of this period come to more than {self.bytes_max} bytes: ask for a shorter period")
        when = (issued_at.year, issued_at.month, issued_at.day, issued_at.hour, issued_at.minute, issued_at.second)
        self.archive.writestr(zipfile.ZipInfo(name, when), content, zipfile.ZIP_DEFLATED)
        self.manifest.append({"name": name, "kind": kind, "amount_nano_usd": amount_nano_usd,
                              "sha256": hashlib.sha256(content).hexdigest()})

    def __enter__(self) -> _Bounded:
        return self

    def __exit__(self, *_: object) -> None:
        self.archive.close()  # a zip given up on halfway is closed too (closing twice does nothing)

    def close(self) -> DocumentsZip:
        text = io.StringIO()
        writer = csv.DictWriter(text, MANIFEST_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.manifest)
        # ZipInfo's own date (1980-01-01): the same period gives the same bytes
        self.archive.writestr(zipfile.ZipInfo(MANIFEST_NAME), text.getvalue(), zipfile.ZIP_DEFLATED)
        self.archive.close()
        return DocumentsZip(self.buffer.getvalue(), self.manifest)


def documents_zip(engine: Engine, settings: InvoiceSettings, account_id: int, kind: str | None, start: datetime,
                  end: datetime, bytes_max: int = DOCUMENTS_ZIP_BYTES_MAX) -> DocumentsZip:
    """Invoices and credit notes (only `kind` when given) issued in [start, end), and, unless a kind
    is asked for, the stored statements of the months inside it; a statement's amount is its closing balance."""
    if end <= start:
        raise InvalidInput("the period is empty: to must be after from")
    with engine.connect() as conn:
        invoices = accounts.list_invoices(conn, account_id, kind, start, end)
        stored = [] if kind else [s for s in statements.list_statements(conn, account_id) if _inside(s["month"], start, end)]
    with _Bounded(bytes_max) as archive:
        for invoice in invoices:
            if invoice["pdf_sha256"] is None:  # numbered, its document not recorded yet: the issuing task is still at it
                raise DocumentUnavailable(f"{invoice['kind'].replace('_', ' ')} {invoice['number']} is numbered but its "
                                          "document is not recorded yet; try again shortly")
            archive.add(f"{FOLDER_OF_KIND[invoice['kind']]}/{invoice['number']}.pdf", invoice["kind"],
                        invoice["amount_nano_usd"], datetime.fromisoformat(invoice["issued_at"]),
                        service.invoice_pdf(engine, settings, invoice["number"]))
        for statement in stored:
            month = statements.parse_month(statement["month"])
            archive.add(f"{FOLDER_OF_KIND[STATEMENT_KIND]}/statement-{account_id}-{month.text}.pdf", STATEMENT_KIND,
                        statement["closing_balance_nano_usd"], datetime.fromisoformat(statement["issued_at"]),
                        statements.stored_pdf(engine, settings, account_id, month, statement_labels))
        return archive.close()


def _inside(month_text: str, start: datetime, end: datetime) -> bool:
    month = statements.parse_month(month_text)
    return start <= month.start and month.end <= end
