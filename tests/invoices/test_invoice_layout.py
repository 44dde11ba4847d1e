"""The invoice's text stays inside the page: a long payment reference (a
Stripe session and event, a chain transfer with its hash and token) breaks
within the right margin instead of running past it, and a short one is set as
before. Checked on the rendered PDF with pdfium's character boxes."""
from __future__ import annotations

import pypdfium2
import pytest

from invoices.limits import REFERENCE_CHARS_UNBROKEN_MAX
from invoices.render import render_pdf

POINTS_PER_MM = 72 / 25.4
RIGHT_MARGIN_MM = 20  # invoice.html's @page margin
EDGE_TOLERANCE_PT = 0.5  # glyph boxes are measured, not laid out: half a point of rounding

DOCUMENT = {
    "number": "PAR-2026-000001", "kind": "invoice", "issued_on": "2026-11-30", "issued_at": "2026-11-30T12:00:00+00:00",
    "source_seq": 7, "corrects": None, "seller": {"name": "Paralon", "address": "1 Road", "email": "billing@paralon.example"},
    "buyer": {"name": "Ada", "email": "ada@example.com", "account_id": 3}, "line": "Inference credits, prepaid",
    "amount_nano_usd": 25_000_000_000, "payment_method": "card",
}
LONG_REFERENCES = [
    "stripe:session:cs_test_" + "a1B2c3D4e5" * 6 + ":event:evt_1PqRsTuVwXyZ012345",
    "chain:8453:tx:0x" + "ab" * 32 + ":log:3:token:0x" + "cd" * 20 + ":raw:25000000",
    "W" * 200,  # the widest glyphs, nowhere to break
]


def _text_right_edge_and_limit(pdf: bytes) -> tuple[float, float, str]:
    page = pypdfium2.PdfDocument(pdf)[0]
    text = page.get_textpage()
    right_edge = max(text.get_charbox(i)[2] for i in range(text.count_chars()))
    return right_edge, page.get_width() - RIGHT_MARGIN_MM * POINTS_PER_MM, text.get_text_range()


@pytest.mark.parametrize("reference", LONG_REFERENCES)
def test_a_long_payment_reference_stays_within_the_right_margin(reference):
    right_edge, limit, text = _text_right_edge_and_limit(render_pdf({**DOCUMENT, "reference": reference}))
    assert right_edge <= limit + EDGE_TOLERANCE_PT, f"text reaches {right_edge:.1f} pt, the margin is at {limit:.1f} pt"
    shown = "".join(text.split())
    assert reference[:20] in shown and reference[-12:] in shown, "the whole reference is shown, only broken"


def test_a_short_reference_is_set_as_before():
    """Up to REFERENCE_CHARS_UNBROKEN_MAX characters the paragraph is unchanged
    (so an issued invoice still renders again to its recorded bytes)."""
    reference = "W" * REFERENCE_CHARS_UNBROKEN_MAX
    right_edge, limit, text = _text_right_edge_and_limit(render_pdf({**DOCUMENT, "reference": reference}))
    assert right_edge <= limit + EDGE_TOLERANCE_PT and reference in text
