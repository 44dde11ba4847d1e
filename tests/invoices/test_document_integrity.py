"""Documents are what was recorded: an invoice, credit note or statement is
mailed (a real SMTP server, aiosmtpd, through `paralon invoices email-pending`)
and downloaded (the real HTTP app) only with the bytes whose SHA-256 its own
database recorded. Two databases sharing one PARALON_INVOICE_DIR (a second
deployment, or a database restored from an older backup) each issue invoice
number 1 for a different customer; a stored file altered on disk is rendered
again from the record, or refused loudly when that does not give the recorded
bytes: never another customer's document. No money moves in any of it."""
from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pypdf
import pytest
from click.testing import CliRunner
from litestar.testing import TestClient
from sqlalchemy import select, update

from app.cli import main
from app.http.factory import create_app
from app.payments.chain_settings import CryptoSettings
from app.payments.stripe import StripeSettings
from app.statement_labels import statement_labels
from app.tokens import CUSTOMER, create_token
from invoices import statements as st
from invoices.schema import invoices as invoices_table
from invoices.schema import statements
from invoices.service import InvoiceSettings, issue_credit_note, issue_for_top_up
from ledger import commands as cmd
from ledger.schema import accounts, ledger_events
from ledger.service import Ledger, append_now
from ledger.verify import verify
from tests.conftest import drop_postgres_database_soon, migrated_database_url, new_postgres_database
from tests.invoices.test_mail import Inbox, _smtp
from tests.invoices.test_statements import history  # noqa: F401 (a fixture)
from tests.ledger.helpers import money_snapshot
from tests.support.harness import free_port, make_fleet

GB = 10**9


def _sha(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def _text(pdf: bytes) -> str:
    return " ".join(" ".join(page.extract_text().split()) for page in pypdf.PdfReader(io.BytesIO(pdf)).pages)


def _recorded(fleet, number: str) -> str:
    """The SHA-256 the ledger of `fleet`'s database recorded for `number`."""
    with fleet.engine.connect() as conn:
        payloads = conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == "InvoiceIssued")).scalars()
        return next(p["pdf_sha256"] for p in map(orjson.loads, payloads) if p["number"] == number)


def _top_up(fleet, amount_nano_usd: int, key: str) -> int:
    return append_now(fleet.engine, cmd.PurchaseCredits(fleet.customer_id, amount_nano_usd, "card", f"stripe:{key}",
                                                        "external:stripe", key)).seq


def _rename(fleet, name: str, email: str | None = None) -> None:
    values = {"name": name} | ({"email": email} if email else {})
    with fleet.engine.begin() as conn:
        conn.execute(update(accounts).where(accounts.c.id == fleet.customer_id).values(**values))


def _download(fleet, settings: InvoiceSettings, number: str):
    """GET /v1/invoices/NUMBER.pdf from the real app on `fleet`'s database, as its customer."""
    with fleet.engine.begin() as conn:
        _, token = create_token(conn, fleet.customer_id, CUSTOMER)
    ledger = Ledger(fleet.engine)
    try:
        app = create_app(ledger, key_cache_ttl_s=0, health_interval_s=60, invoice_settings=settings,
                         stripe_settings=StripeSettings(None, None, None, 500, 1_000_000, "http://test/done", "http://test/cancelled"),
                         crypto_settings=CryptoSettings(None, (), 12, None))
        with TestClient(app) as client:
            return client.get(f"/v1/invoices/{number}.pdf", headers={"authorization": f"Bearer {token}"})
    finally:
        ledger.close()


def _email_pending(fleet, settings: InvoiceSettings, port: int) -> dict:
    env = {"PARALON_DATABASE_URL": fleet.database_url, "PARALON_SMTP_HOST": "127.0.0.1", "PARALON_SMTP_PORT": str(port),
           "PARALON_INVOICE_DIR": str(settings.storage_dir)}
    result = CliRunner().invoke(main, ["invoices", "email-pending", "--json"], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["outcomes"]


@pytest.fixture
def smtp():
    inbox, port = Inbox(), free_port()
    server = _smtp(port, inbox)
    yield inbox, port
    server.stop()


@pytest.fixture(params=["second deployment", "restored backup"])
def two_databases(request, database_url, tmp_path):
    """Two databases whose customers differ: the second migrated afresh (another
    deployment), or cloned from the same migrated template as the first (what a
    database restored from a backup of it is)."""
    backend = "sqlite" if database_url.startswith("sqlite") else "postgresql"
    if request.param == "restored backup":
        (tmp_path / "restored").mkdir()
        second_url = migrated_database_url(request, backend, tmp_path / "restored")
    elif backend == "sqlite":
        second_url = f"sqlite:///{tmp_path}/second.db"
    else:
        second_url = new_postgres_database()
        request.addfinalizer(lambda: drop_postgres_database_soon(second_url))
    first, second = make_fleet(database_url, [], credits_usd="0"), make_fleet(second_url, [], credits_usd="0")
    _rename(second, "Grace Hopper", "grace@example.com")
    yield first, second, request.param
    first.engine.dispose()
    second.engine.dispose()


def test_two_databases_issuing_one_number_each_mail_and_serve_their_own(two_databases, smtp, tmp_path):
    first, second, how = two_databases
    inbox, port = smtp
    shared = InvoiceSettings(tmp_path / "shared-invoice-dir")
    ada = issue_for_top_up(first.engine, shared, _top_up(first, 25 * GB, "ada-1"))
    grace = issue_for_top_up(second.engine, shared, _top_up(second, 7 * GB, "grace-1"))
    assert ada["number"] == grace["number"], "each database numbers from 1"
    before = {id(f): money_snapshot(f.engine) for f in (first, second)}

    for fleet, invoice, buyer, email, amount in ((first, ada, "test customer", "customer@example.com", "25.00"),
                                                 (second, grace, "Grace Hopper", "grace@example.com", "7.00")):
        recorded = _recorded(fleet, invoice["number"])
        assert _email_pending(fleet, shared, port) == {invoice["number"]: "sent"}
        message = next(m for m in inbox.messages if m["To"] == email)
        attached = next(message.iter_attachments()).get_content()
        assert _sha(attached) == recorded, "the mail carries the document this database recorded"
        assert buyer in _text(attached) and amount in _text(attached), f"{email} got another customer's invoice"
        download = _download(fleet, shared, invoice["number"])
        assert download.status_code == 200 and _sha(download.content) == recorded and buyer in _text(download.content)
    assert len(inbox.messages) == 2
    assert ada["pdf_path"] != grace["pdf_path"], "one storage key per deployment and content"
    if how == "second deployment":
        assert Path(ada["pdf_path"]).parents[1] != Path(grace["pdf_path"]).parents[1], "each deployment has its own directory"
    for fleet in (first, second):
        assert money_snapshot(fleet.engine) == before[id(fleet)]
        with fleet.engine.connect() as conn:
            assert verify(conn).ok


@pytest.fixture
def fleet(database_url):
    fleet = make_fleet(database_url, [], credits_usd="0")
    yield fleet
    fleet.engine.dispose()


@contextmanager
def _errors_logged(name: str) -> Iterator[list[str]]:
    logged: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger(name).addHandler(handler)
    try:
        yield logged
    finally:
        logging.getLogger(name).removeHandler(handler)


def test_an_altered_file_is_rendered_again_or_refused_never_served(fleet, smtp, tmp_path):
    inbox, port = smtp
    settings = InvoiceSettings(tmp_path / "invoices")
    top_up = _top_up(fleet, 25 * GB, "t1")
    invoice = issue_for_top_up(fleet.engine, settings, top_up)
    refund = append_now(fleet.engine, cmd.RefundCredits(fleet.customer_id, 5 * GB, "card", "re_1", "external:stripe", "refund-1")).seq
    credit_note = issue_credit_note(fleet.engine, settings, refund, top_up)
    before = money_snapshot(fleet.engine)
    someone_elses = b"%PDF-1.7 another customer's invoice"
    for document in (invoice, credit_note):
        Path(document["pdf_path"]).write_bytes(someone_elses)
        download = _download(fleet, settings, document["number"])
        assert download.status_code == 200 and _sha(download.content) == _recorded(fleet, document["number"]), \
            "rendered again from the database to the recorded bytes"
    Path(invoice["pdf_path"]).write_bytes(someone_elses)
    Path(credit_note["pdf_path"]).unlink()
    assert _email_pending(fleet, settings, port) == {invoice["number"]: "sent", credit_note["number"]: "sent"}
    for message in inbox.messages:
        number = next(message.iter_attachments()).get_filename().removesuffix(".pdf")
        assert _sha(next(message.iter_attachments()).get_content()) == _recorded(fleet, number)

    # The buyer's name changed since: rendering again no longer gives the recorded bytes.
    _rename(fleet, "Someone Else")
    for path in Path(settings.storage_dir).rglob("*.pdf"):
        path.write_bytes(someone_elses)
    with _errors_logged("invoices.files") as logged:  # on its own logger: the app configures the root one at start
        refused = _download(fleet, settings, invoice["number"])
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "document_unavailable" and someone_elses not in refused.content
    assert any(invoice["number"] in message for message in logged), logged
    with fleet.engine.begin() as conn:  # asked to mail it again: nothing is sent
        conn.execute(update(invoices_table).values(emailed_at=None, email_claimed_at=None))
    outcomes = _email_pending(fleet, settings, port)
    assert all(o.startswith("failed: ") for o in outcomes.values()) and len(inbox.messages) == 2, outcomes
    assert money_snapshot(fleet.engine) == before
    with fleet.engine.connect() as conn:
        assert verify(conn).ok


def test_a_stored_statement_is_served_only_as_recorded(history):  # noqa: F811 (the fixture)
    fleet, settings = history
    october = st.parse_month("2026-10")
    issued = st.issue(fleet.engine, settings, fleet.customer_id, october, statement_labels)
    before = money_snapshot(fleet.engine)
    Path(issued["pdf_path"]).write_bytes(b"%PDF-1.7 another account's statement")
    pdf, provisional = st.document(fleet.engine, settings, fleet.customer_id, october, statement_labels)
    assert not provisional and _sha(pdf) == issued["pdf_sha256"]
    assert "Statement 2026-10" in _text(pdf) and "test customer" in _text(pdf)

    _rename(fleet, "Someone Else")
    with fleet.engine.connect() as conn:
        stored_at = conn.execute(select(statements.c.pdf_path).where(statements.c.account_id == fleet.customer_id)).scalar_one()
    Path(stored_at).write_bytes(b"%PDF-1.7 another account's statement")
    from invoices.files import DocumentUnavailable

    with pytest.raises(DocumentUnavailable):
        st.document(fleet.engine, settings, fleet.customer_id, october, statement_labels)
    assert money_snapshot(fleet.engine) == before
    with fleet.engine.connect() as conn:
        assert verify(conn).ok
