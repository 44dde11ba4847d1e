"""Invoices for credited top-ups: gapless numbers under concurrency, one per
top-up, a PDF/A-3b whose text says what it should and whose hash is on the chain."""
from __future__ import annotations

import hashlib
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pypdf
import pytest
from sqlalchemy import select

from invoices.service import InvoiceSettings, issue_for_top_up, list_invoices
from ledger import commands as cmd
from ledger.errors import InvalidInput
from ledger.schema import ledger_events
from ledger.service import append_now
from ledger.verify import verify
from tests.support.harness import make_fleet

OUTPUT = Path(__file__).resolve().parents[2] / "test-output"


def _top_ups(fleet, count: int, cents: int = 2500) -> list[int]:
    return [append_now(fleet.engine, cmd.PurchaseCredits(
        fleet.customer_id, cents * 10**7, "card", f"stripe:session:cs_{i}", "external:stripe", f"top-up:{i}")).seq
        for i in range(count)]


@pytest.fixture
def fleet(database_url):
    fleet = make_fleet(database_url, [], credits_usd="0")
    yield fleet
    fleet.engine.dispose()


def test_50_concurrent_top_ups_get_50_distinct_consecutive_numbers(fleet, tmp_path):
    settings = InvoiceSettings(tmp_path / "invoices")
    seqs = _top_ups(fleet, 50)
    with ThreadPoolExecutor(max_workers=10) as pool:
        issued = list(pool.map(lambda seq: issue_for_top_up(fleet.engine, settings, seq), seqs + seqs[:10]))
    numbers = sorted({i["number"] for i in issued})
    year = issued[0]["issued_at"][:4]
    assert numbers == [f"PAR-{year}-{n:06d}" for n in range(1, 51)], "gapless, and never twice for one top-up"
    by_seq = {}
    for invoice in issued:
        assert by_seq.setdefault(invoice["source_seq"], invoice["number"]) == invoice["number"]
    assert len(list_invoices(fleet.engine, fleet.customer_id)) == 50
    assert fleet.events("InvoiceIssued") == 50
    with fleet.engine.connect() as conn:
        assert verify(conn).ok


def test_the_pdf_says_what_it_should_and_its_hash_is_on_the_chain(fleet, tmp_path):
    seq = append_now(fleet.engine, cmd.PurchaseCredits(
        fleet.customer_id, 3_500_001_000, "crypto", "chain:1:tx:0xabc:log:0", "external:stripe", "usdc:1")).seq
    invoice = issue_for_top_up(fleet.engine, InvoiceSettings(tmp_path / "invoices"), seq)
    pdf = Path(invoice["pdf_path"]).read_bytes()
    assert hashlib.sha256(pdf).hexdigest() == invoice["pdf_sha256"]
    text = " ".join(pypdf.PdfReader(io.BytesIO(pdf)).pages[0].extract_text().split())
    for expected in (invoice["number"], "Seller", "Paralon", "Buyer", "test customer", "3.50", "crypto",
                     "chain:1:tx:0xabc:log:0", "half away from zero", "3500001000 nano-USD"):
        assert expected in text, expected
    xmp = pypdf.PdfReader(io.BytesIO(pdf)).trailer["/Root"]["/Metadata"].get_object().get_data()
    assert b"pdfaid:part" in xmp and b"3" in xmp.split(b"pdfaid:part")[1][:6], "identifies itself as PDF/A-3"
    assert b"pdfaid:conformance" in xmp and b"B" in xmp.split(b"pdfaid:conformance")[1][:6]
    with fleet.engine.connect() as conn:
        recorded = orjson.loads(conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == "InvoiceIssued")).scalar_one())
    assert recorded["pdf_sha256"] == invoice["pdf_sha256"] and recorded["number"] == invoice["number"]
    _png(pdf, OUTPUT / "invoice-page-1.png")
    again = issue_for_top_up(fleet.engine, InvoiceSettings(tmp_path / "invoices"), seq)
    assert again == invoice and fleet.events("InvoiceIssued") == 1


def _png(pdf: bytes, path: Path) -> None:
    """One page as a picture, in test-output/, for a person to look at."""
    import pypdfium2

    path.parent.mkdir(parents=True, exist_ok=True)
    page = pypdfium2.PdfDocument(pdf)[0]
    page.render(scale=1.5).to_pil().save(path)
    assert path.stat().st_size > 10_000


def test_only_credited_top_ups_are_invoiced(fleet, tmp_path):
    grant = append_now(fleet.engine, cmd.GrantCredits(fleet.customer_id, 10**9, "goodwill", "g")).seq
    for seq in (grant, 999_999):
        with pytest.raises(InvalidInput):
            issue_for_top_up(fleet.engine, InvoiceSettings(tmp_path / "invoices"), seq)
    assert list_invoices(fleet.engine, fleet.customer_id) == []


def test_amounts_are_shown_to_the_cent_half_away_from_zero():
    from invoices.render import cents_text

    shown = {amount: cents_text(amount) for amount in (0, 4_999_999, 5_000_000, -5_000_000, -4_999_999, -2_000_001,
                                                       1_234_567_890_123, 10**9)}
    assert shown == {0: "0.00", 4_999_999: "0.00", 5_000_000: "0.01", -5_000_000: "-0.01", -4_999_999: "0.00",
                     -2_000_001: "0.00", 1_234_567_890_123: "1,234.57", 10**9: "1.00"}, "and never -0.00"
