"""A period's documents in one zip (GET /v1/invoices.zip, `paralon invoices
zip`): every invoice and credit note issued in it and the stored statement of
every month inside it, each with exactly the SHA-256 its record holds, and a
manifest that says so. A document that can be had neither from its file nor
by rendering it again fails the whole download (503 document_unavailable, the
command writes no file): never a partial zip. Nothing here moves money."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import zipfile
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from litestar.testing import TestClient
from sqlalchemy import select, update

from app.cli import main
from app.documents_zip import MANIFEST_COLUMNS, MANIFEST_NAME, documents_zip
from app.http.factory import create_app
from app.payments.chain_settings import CryptoSettings
from app.payments.stripe import StripeSettings
from app.statement_labels import statement_labels
from app.tokens import create_token
from invoices import statements as st
from invoices.schema import statements
from invoices.service import issue_credit_note, issue_for_top_up
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.errors import InvalidInput
from ledger.schema import accounts, ledger_events
from ledger.service import Ledger
from tests.invoices.test_statements import GB, at, history  # noqa: F401 (a fixture)
from tests.ledger.helpers import money_snapshot

ISSUED_AT = at("2026-11-02T10:00:00")  # the invoices are issued in November, after October's statement


def _seq(fleet, idempotency_key: str) -> int:
    with fleet.engine.connect() as conn:
        return conn.execute(select(ledger_events.c.seq).where(ledger_events.c.idempotency_key == idempotency_key)).scalar_one()


@pytest.fixture
def papers(history, monkeypatch):  # noqa: F811 (the fixture)
    """The history's October statement, the invoice of its $25 top-up and the credit note of its $5 refund."""
    fleet, settings = history
    monkeypatch.setattr("invoices.service.utc_now", lambda: ISSUED_AT)
    statement = st.issue(fleet.engine, settings, fleet.customer_id, st.parse_month("2026-10"), statement_labels,
                         now=at("2026-11-02T09:00:00"))
    invoice = issue_for_top_up(fleet.engine, settings, _seq(fleet, "buy-1"))
    credit_note = issue_credit_note(fleet.engine, settings, _seq(fleet, "refund-1"), _seq(fleet, "buy-1"))
    with fleet.engine.begin() as conn:
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == "platform:revenue")).scalar_one()
        other = acc.create_account(conn, cmd.CUSTOMER, "someone else")
        tokens = {role: create_token(conn, account, role)[1] for role, account in (
            ("customer", fleet.customer_id), ("accountant", fleet.customer_id), ("owner", fleet.owner_ids[0]),
            ("admin", platform))} | {"other": create_token(conn, other, "customer")[1]}
    ledger = Ledger(fleet.engine)
    app = create_app(ledger, key_cache_ttl_s=0, health_interval_s=60, invoice_settings=settings,
                     stripe_settings=StripeSettings(None, None, None, 500, 1_000_000, "http://test/done", "http://test/cancelled"),
                     crypto_settings=CryptoSettings(None, (), 12, None))
    with TestClient(app) as client:
        def get(path: str, role: str):
            return client.get(path, headers={"authorization": f"Bearer {tokens[role]}"})

        yield fleet, settings, get, {"statement": statement, "invoice": invoice, "credit_note": credit_note}
    ledger.close()


def _recorded_sha256(fleet, number: str) -> str:
    """The SHA-256 the InvoiceIssued event on the chain holds for `number`."""
    with fleet.engine.connect() as conn:
        payloads = conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == "InvoiceIssued")).scalars()
        return next(p["pdf_sha256"] for p in map(orjson.loads, payloads) if p["number"] == number)


def _opened(content: bytes) -> tuple[dict[str, bytes], list[dict]]:
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    manifest = list(csv.DictReader(io.StringIO(files.pop(MANIFEST_NAME).decode())))
    return files, manifest


def test_the_zip_holds_each_document_with_its_recorded_sha256_and_says_so(papers):
    fleet, _, get, issued = papers
    before = money_snapshot(fleet.engine)
    response = get("/v1/invoices.zip?from=2026-10&to=2026-12", "accountant")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/zip"
    files, manifest = _opened(response.content)
    invoice, credit_note = issued["invoice"]["number"], issued["credit_note"]["number"]
    recorded = {f"invoices/{invoice}.pdf": _recorded_sha256(fleet, invoice),
                f"credit_notes/{credit_note}.pdf": _recorded_sha256(fleet, credit_note),
                f"statements/statement-{fleet.customer_id}-2026-10.pdf": issued["statement"]["pdf_sha256"]}
    assert {name: hashlib.sha256(content).hexdigest() for name, content in files.items()} == recorded
    assert all(content.startswith(b"%PDF") for content in files.values())
    assert list(manifest[0]) == list(MANIFEST_COLUMNS)
    assert [(m["name"], m["kind"], int(m["amount_nano_usd"]), m["sha256"]) for m in manifest] == [
        (f"invoices/{invoice}.pdf", "invoice", 25 * GB, recorded[f"invoices/{invoice}.pdf"]),
        (f"credit_notes/{credit_note}.pdf", "credit_note", 5 * GB, recorded[f"credit_notes/{credit_note}.pdf"]),
        (f"statements/statement-{fleet.customer_id}-2026-10.pdf", "statement", issued["statement"]["closing_balance_nano_usd"],
         issued["statement"]["pdf_sha256"])]

    only_credit_notes, manifest = _opened(get("/v1/invoices.zip?from=2026-10&to=2026-12&kind=credit_note", "customer").content)
    assert list(only_credit_notes) == [f"credit_notes/{credit_note}.pdf"] and len(manifest) == 1, "a kind asked for: no statements"
    november, _ = _opened(get("/v1/invoices.zip?from=2026-11&to=2026-12", "customer").content)
    assert sorted(november) == [f"credit_notes/{credit_note}.pdf", f"invoices/{invoice}.pdf"], "October is not inside the period"
    october_only, manifest = _opened(get("/v1/invoices.zip?from=2026-10-02&to=2026-11", "customer").content)
    assert october_only == {} and manifest == [], "a month only partly inside the period brings no statement"

    as_admin = get(f"/v1/invoices.zip?from=2026-10&to=2026-12&account_id={fleet.customer_id}", "admin")
    assert as_admin.content == response.content, "the same documents give the same bytes"
    assert get(f"/v1/invoices.zip?from=2026-10&to=2026-12&account_id={fleet.customer_id}", "other").status_code == 404
    assert _opened(get("/v1/invoices.zip?from=2026-10&to=2026-12", "other").content) == ({}, [])
    assert get("/v1/invoices.zip?from=2026-10&to=2026-12", "owner").status_code == 403
    assert money_snapshot(fleet.engine) == before


def test_the_cli_writes_the_zip_the_api_sends(papers, tmp_path):
    fleet, settings, get, _ = papers
    env = {"PARALON_DATABASE_URL": fleet.database_url, "PARALON_INVOICE_DIR": str(settings.storage_dir)}
    output = tmp_path / "october.zip"
    result = CliRunner().invoke(main, ["invoices", "zip", str(fleet.customer_id), "--from", "2026-10", "--to", "2026-12",
                                       "--output", str(output), "--json"], env=env)
    assert result.exit_code == 0, result.output
    assert output.read_bytes() == get("/v1/invoices.zip?from=2026-10&to=2026-12", "customer").content
    assert [d["name"] for d in json.loads(result.stdout)["documents"]] == [m["name"] for m in _opened(output.read_bytes())[1]]


def test_a_document_that_cannot_be_had_fails_the_whole_zip(papers, tmp_path):
    fleet, settings, get, issued = papers
    before = money_snapshot(fleet.engine)
    with fleet.engine.begin() as conn:  # the buyer's name changed since: rendering again no longer gives the recorded bytes
        conn.execute(update(accounts).where(accounts.c.id == fleet.customer_id).values(name="Someone Else"))
    Path(issued["credit_note"]["pdf_path"]).write_bytes(b"%PDF-1.7 another customer's credit note")
    refused = get("/v1/invoices.zip?from=2026-10&to=2026-12", "customer")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "document_unavailable"
    assert not refused.content.startswith(b"PK"), "no zip at all, not a partial one"
    only_invoice = get("/v1/invoices.zip?from=2026-10&to=2026-12&kind=invoice", "customer")
    assert only_invoice.status_code == 200, "the invoice's own file is intact"
    assert list(_opened(only_invoice.content)[0]) == [f"invoices/{issued['invoice']['number']}.pdf"]

    output = tmp_path / "refused.zip"
    result = CliRunner().invoke(main, ["invoices", "zip", str(fleet.customer_id), "--from", "2026-10", "--to", "2026-12",
                                       "--output", str(output), "--json"],
                                env={"PARALON_DATABASE_URL": fleet.database_url, "PARALON_INVOICE_DIR": str(settings.storage_dir)})
    assert result.exit_code == 2 and json.loads(result.stderr)["error"]["code"] == "document_unavailable"
    assert not output.exists()

    with fleet.engine.connect() as conn:
        stored = conn.execute(select(statements.c.pdf_path).where(statements.c.account_id == fleet.customer_id)).scalar_one()
    Path(stored).write_bytes(b"%PDF-1.7 another account's statement")
    assert get("/v1/invoices.zip?from=2026-10&to=2026-11", "customer").status_code == 503, "a statement counts the same"
    assert money_snapshot(fleet.engine) == before


def test_a_zip_larger_than_its_bound_is_refused(papers):
    fleet, settings, get, issued = papers
    start, end = st.parse_month("2026-10").start, st.parse_month("2026-12").start
    whole = documents_zip(fleet.engine, settings, fleet.customer_id, None, start, end)
    just_enough = sum(len(c) for c in _opened(whole.content)[0].values())
    assert documents_zip(fleet.engine, settings, fleet.customer_id, None, start, end, bytes_max=just_enough).content == whole.content
    with pytest.raises(InvalidInput, match="shorter period"):
        documents_zip(fleet.engine, settings, fleet.customer_id, None, start, end, bytes_max=just_enough - 1)
