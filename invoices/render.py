"""Invoices, credit notes and statements as PDF/A-3b: a Jinja2 template rendered by
WeasyPrint, with the fonts shipped beside it (the output must not depend on
what fonts a machine has)."""
from __future__ import annotations

import os
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape

from invoices.limits import PDF_FONT_TIMESTAMP_S, REFERENCE_CHARS_UNBROKEN_MAX
from ledger.money import NANO_USD_PER_USD, nano_usd_to_usd_text

HERE = Path(__file__).resolve().parent
_templates = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
PDF_VARIANT = "pdf/a-3b"
# Where HarfBuzz-subset is missing, WeasyPrint subsets fonts with fontTools, which
# stamps each embedded font with the time of rendering unless SOURCE_DATE_EPOCH
# is set. Pinned, one document always renders to the same bytes: a stored PDF
# that was lost or altered can be rendered again to the SHA-256 recorded for it.
os.environ.setdefault("SOURCE_DATE_EPOCH", str(PDF_FONT_TIMESTAMP_S))


def cents_text(amount_nano_usd: int) -> str:
    """Shown to the cent, half away from zero (the rule printed on every invoice)."""
    usd = (Decimal(abs(amount_nano_usd)) / NANO_USD_PER_USD).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    return f"{'-' if amount_nano_usd < 0 and usd else ''}{usd:,.2f}"  # never "-0.00"


_templates.filters.update(usd=cents_text, exact_usd=nano_usd_to_usd_text)
_templates.globals.update(reference_chars_unbroken_max=REFERENCE_CHARS_UNBROKEN_MAX)


def render_pdf(document: dict) -> bytes:
    """document: number, kind, issued_on, seller, buyer, line, amount_nano_usd,
    payment_method, reference, source_seq, corrects (credit notes)."""
    return _pdf("invoice.html", title="Credit note" if document["kind"] == "credit_note" else "Invoice",
                amount=cents_text(document["amount_nano_usd"]), exact_nano_usd=document["amount_nano_usd"],
                exact_usd=nano_usd_to_usd_text(document["amount_nano_usd"]), **document)


def render_statement_pdf(statement: dict) -> bytes:
    """statement: the figures of `invoices.statements.build`."""
    return _pdf("statement.html", title="Statement", **statement)


# templates/_document_head.html is the invoices' and receipts' shared style: an edit to it changes
# the bytes of every document rendered again, which then no longer match their recorded SHA-256.
def render_payout_receipt_pdf(receipt: dict) -> bytes:
    """receipt: app/payments/payout_receipts.py's figures of a settled payout."""
    return _pdf("payout_receipt.html", title="Payout receipt", **receipt)


def _pdf(template: str, **context) -> bytes:
    # Imported here: WeasyPrint takes about 0.5 s of CPU to import, which every
    # `paralon serve` replica and command would pay although only PDF work needs it.
    from weasyprint import HTML

    html = _templates.get_template(template).render(fonts=(HERE / "fonts").as_uri(), currency="USD", **context)
    return HTML(string=html, base_url=str(HERE)).write_pdf(pdf_variant=PDF_VARIANT)
