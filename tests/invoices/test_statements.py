"""Monthly statements: opening and closing balances that reconcile with the
ledger to the nano-dollar across month boundaries, usage by model and key,
owners' earnings per worker and model per day, stored once per closed month.

Events are recorded in past months by setting the clock the ledger stamps
appends with (`ledger.store.utc_now`); nothing else about time is faked."""
from __future__ import annotations

import hashlib
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pypdf
import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from app.cli import main
from app.statement_labels import statement_labels
from invoices import read_models
from invoices import statements as st
from invoices.limits import CLOSE_GRACE_S
from invoices.render import cents_text
from invoices.schema import account_postings, statements
from invoices.service import InvoiceSettings
from invoices.tasks import ISSUE_STATEMENTS
from ledger import commands as cmd
from ledger.errors import InvalidInput, InvariantBroken, WrongAccountKind
from ledger.holds import PlaceHold
from ledger.money import nano_usd_to_usd_text
from ledger.schema import accounts
from ledger.service import Ledger, append_now
from tests.invoices.test_invoices import OUTPUT, _png
from tests.support.celery_worker import celery_worker  # noqa: F401 (a fixture)
from tests.support.harness import make_fleet

C1, C2, C3, C4 = 1_234_567, 2_000_001, 777, 999  # charges, nano-USD
GB = 10**9


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


class Clock:
    def __init__(self, monkeypatch) -> None:
        self.now = at("2026-09-15T12:00:00")
        # The ledger records at this time, and the statements in this process are made at it:
        # November stays the open month whatever the date. A `serve` subprocess keeps the real clock.
        for where in ("ledger.store.utc_now", "invoices.statements.utc_now", "app.cli.billing.utc_now"):
            monkeypatch.setattr(where, lambda: self.now)


def _settle(ledger: Ledger, fleet, name: str, model: str, charge: int) -> int:
    hold = ledger.place_hold(PlaceHold(fleet.customer_id, 10**7, f"h-{name}"))
    return ledger.append(cmd.SettleRequest(hold.hold_id, fleet.owner_ids[0], charge, f"req-{name}", f"s-{name}",
                                           {"model": model, "worker_id": fleet.worker_ids[0], "api_key_id": fleet.key_id,
                                            "prompt_tokens": 10, "completion_tokens": 20})).seq


@pytest.fixture
def history(database_url, monkeypatch, tmp_path):
    """September: $10 granted, $25 bought, one request in its last microsecond.
    October: one request in its first microsecond, a $5 refund, a $3 dispute
    won, a request reversed, a $1 adjustment. November (open): one request."""
    clock = Clock(monkeypatch)
    fleet = make_fleet(database_url, ["http://127.0.0.1:1"])
    ledger = Ledger(fleet.engine)
    c = fleet.customer_id

    def when(text: str, command) -> int:
        clock.now = at(text)
        return append_now(fleet.engine, command).seq

    when("2026-09-20T10:00:00", cmd.PurchaseCredits(c, 25 * GB, "card", "cs_test_1", "external:stripe", "buy-1"))
    clock.now = at("2026-09-30T23:59:59.999999")
    _settle(ledger, fleet, "1", "m-a", C1)
    clock.now = at("2026-10-01T00:00:00")
    _settle(ledger, fleet, "2", "m-b", C2)
    when("2026-10-05T09:00:00", cmd.RefundCredits(c, 5 * GB, "card", "re_1", "external:stripe", "refund-1"))
    frozen = when("2026-10-10T09:00:00", cmd.FreezeCredits(c, 3 * GB, "dp_1", "external:stripe:disputed", "freeze-1"))
    when("2026-10-12T09:00:00", cmd.ReverseEvent(frozen, "dispute won", "won-1"))
    clock.now = at("2026-10-15T09:00:00")
    settled = _settle(ledger, fleet, "3", "m-a", C3)
    when("2026-10-16T09:00:00", cmd.ReverseEvent(settled, "refunded a bad answer", "rev-3"))
    when("2026-10-20T09:00:00", cmd.AdjustBalance(c, GB, "goodwill", "adj-1"))
    clock.now = at("2026-11-02T09:00:00")
    _settle(ledger, fleet, "4", "m-a", C4)
    ledger.close()
    yield fleet, InvoiceSettings(tmp_path / "documents")
    fleet.engine.dispose()


SEPTEMBER_CLOSING = 35 * GB - C1
OCTOBER_CLOSING = SEPTEMBER_CLOSING - C2 - 5 * GB + GB


def test_a_customer_statement_reconciles_with_the_ledger_across_month_boundaries(history):
    fleet, settings = history
    september = st.figures(fleet.engine, settings, fleet.customer_id, st.parse_month("2026-09"), statement_labels)
    assert september["opening_balance_nano_usd"] == 0 and not september["provisional"]
    assert september["closing_balance_nano_usd"] == SEPTEMBER_CLOSING
    assert [(line["model"], line["requests"], line["amount_nano_usd"]) for line in september["lines"]] == [("m-a", 1, -C1)]

    october = st.figures(fleet.engine, settings, fleet.customer_id, st.parse_month("2026-10"), statement_labels)
    assert october["opening_balance_nano_usd"] == SEPTEMBER_CLOSING, "a month opens where the last one closed"
    assert october["closing_balance_nano_usd"] == OCTOBER_CLOSING
    sections = {s["title"]: (s["postings"], s["amount_nano_usd"]) for s in october["sections"]}
    assert sections == {"Usage": (3, -C2), "Refunds": (1, -5 * GB), "Disputes": (2, 0), "Adjustments": (1, GB)}
    assert [(line["model"], line["api_key_id"], line["requests"], line["prompt_tokens"], line["amount_nano_usd"])
            for line in october["lines"]] == [("m-b", fleet.key_id, 1, 10, -C2)]
    assert october["lines"][0]["api_key"].startswith("sk-par-"), "keys are named as their owner sees them"
    assert [i["title"] for i in october["itemised"]] == ["Refunds", "Disputes", "Disputes", "Adjustments"]

    november = st.figures(fleet.engine, settings, fleet.customer_id, st.parse_month("2026-11"), statement_labels)
    assert november["provisional"] and november["opening_balance_nano_usd"] == OCTOBER_CLOSING
    assert november["closing_balance_nano_usd"] == fleet.balance(fleet.customer_id).balance_nano_usd == OCTOBER_CLOSING - C4
    assert st.reconcile(fleet.engine, st.parse_month("2026-10").end) == {}


def test_an_owner_statement_lists_earnings_per_worker_and_model_per_day(history):
    fleet, settings = history
    owner = fleet.owner_ids[0]
    september = st.figures(fleet.engine, settings, owner, st.parse_month("2026-09"), statement_labels)
    october = st.figures(fleet.engine, settings, owner, st.parse_month("2026-10"), statement_labels)
    assert [(line["day"], line["worker_id"], line["model"], line["requests"], line["amount_nano_usd"]) for line in september["lines"]] == [
        ("2026-09-30", fleet.worker_ids[0], "m-a", 1, C1 * 80 // 100)]
    assert [(line["day"], line["model"], line["requests"], line["amount_nano_usd"]) for line in october["lines"]] == [
        ("2026-10-01", "m-b", 1, C2 * 80 // 100), ("2026-10-15", "m-a", 1, C3 * 80 // 100),
        ("2026-10-16", "m-a", -1, -(C3 * 80 // 100))], "a reversal counts on the day it was recorded"
    assert october["opening_balance_nano_usd"] == september["closing_balance_nano_usd"] == C1 * 80 // 100
    november = st.figures(fleet.engine, settings, owner, st.parse_month("2026-11"), statement_labels)
    assert november["closing_balance_nano_usd"] == fleet.balance(owner).balance_nano_usd


def test_a_closed_month_is_stored_once_as_pdf(history):
    fleet, settings = history
    october = st.parse_month("2026-10")
    assert st.missing_statements(fleet.engine, october) == [fleet.customer_id, fleet.owner_ids[0]]
    issued = st.issue(fleet.engine, settings, fleet.customer_id, october, statement_labels, month_reconciled=True)
    again = st.issue(fleet.engine, settings, fleet.customer_id, october, statement_labels)
    assert again == issued and issued["closing_balance_nano_usd"] == OCTOBER_CLOSING
    pdf = Path(issued["pdf_path"]).read_bytes()
    text = " ".join(" ".join(page.extract_text().split()) for page in pypdf.PdfReader(io.BytesIO(pdf)).pages)
    for expected in ("Statement 2026-10", "test customer", "Opening balance", cents_text(SEPTEMBER_CLOSING),
                     "Closing balance", cents_text(OCTOBER_CLOSING), "Usage by model and API key", "m-b", "Refunds",
                     "re_1", "dispute won", "half away from zero", f"event {issued['through_seq']}"):
        assert expected in text, expected
    assert "Provisional" not in text
    _png(pdf, OUTPUT / "statement-page-1.png")
    owner = st.issue(fleet.engine, settings, fleet.owner_ids[0], october, statement_labels)
    owner_text = " ".join(pypdf.PdfReader(owner["pdf_path"]).pages[0].extract_text().split())
    assert "Earnings per worker and model, by day" in owner_text and "2026-10-01" in owner_text
    with fleet.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(statements)).scalar_one() == 2


def test_statements_refuse_what_they_cannot_state_and_store_nothing(history):
    fleet, settings = history
    with fleet.engine.connect() as conn:
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == "platform:revenue")).scalar_one()
    refusals = [
        (InvalidInput, lambda: st.parse_month("2026-13")),
        (InvalidInput, lambda: st.parse_month("26-10")),
        (InvalidInput, lambda: st.issue(fleet.engine, settings, fleet.customer_id, st.parse_month("2026-11"), statement_labels)),
        (InvalidInput, lambda: st.figures(fleet.engine, settings, fleet.customer_id, st.parse_month("2099-01"), statement_labels)),
        (WrongAccountKind, lambda: st.figures(fleet.engine, settings, platform, st.parse_month("2026-10"), statement_labels)),
        (InvalidInput, lambda: st.parse_month("1970-01")),
        (InvalidInput, lambda: st.parse_month("9999-12")),
        (st.NoStatement, lambda: st.issue(fleet.engine, settings, fleet.customer_id, st.parse_month("2026-08"), statement_labels)),
    ]
    for error, call in refusals:
        with pytest.raises(error):
            call()

    # A read model that disagrees with the ledger stops the month and the account.
    with fleet.engine.begin() as conn:
        conn.execute(account_postings.insert().values(
            account_id=fleet.customer_id, event_seq=10**9, leg=0, recorded_at=at("2026-10-03T00:00:00"), event_type="BalanceAdjusted",
            source_type="BalanceAdjusted", amount_nano_usd=1, model="", api_key_id=0, worker_id=0, reference="not in the ledger"))
    october = st.parse_month("2026-10")
    with pytest.raises(InvariantBroken, match=str(fleet.customer_id)):
        st.missing_statements(fleet.engine, october)
    with pytest.raises(InvariantBroken):
        st.issue(fleet.engine, settings, fleet.customer_id, october, statement_labels)
    with fleet.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(statements)).scalar_one() == 0
    assert not settings.storage_dir.exists() or not any(settings.storage_dir.rglob("*.pdf"))


def test_the_cli_issues_shows_and_lists_statements(history):
    fleet, settings = history
    env = {"PARALON_DATABASE_URL": fleet.database_url, "PARALON_INVOICE_DIR": str(settings.storage_dir)}

    def run(*args: str, expect: int = 0):
        result = CliRunner().invoke(main, list(args), env=env)
        assert result.exit_code == expect, result.output
        return result

    issued = json.loads(run("statements", "issue", "--month", "2026-10", "--json").stdout)
    assert [s["account_id"] for s in issued["statements"]] == [fleet.customer_id, fleet.owner_ids[0]]
    shown = json.loads(run("statements", "show", str(fleet.customer_id), "--month", "2026-10", "--json").stdout)
    assert shown["closing_balance_nano_usd"] == OCTOBER_CLOSING
    assert f"closing {nano_usd_to_usd_text(OCTOBER_CLOSING)} USD" in run("statements", "show", str(fleet.customer_id), "--month", "2026-10").stdout
    listed = json.loads(run("statements", "list", str(fleet.customer_id), "--json").stdout)["statements"]
    assert [s["month"] for s in listed] == ["2026-10"]
    for bad in (["statements", "issue", "--month", "2026-11"], ["statements", "issue", "--month", "october"],
                ["statements", "show", "999999", "--month", "2026-10"]):
        assert json.loads(run(*bad, "--json", expect=2).stderr)["error"]["code"]
    with fleet.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(statements)).scalar_one() == 2


def test_months():
    assert st.parse_month("2026-12").end == at("2027-01-01T00:00:00")
    assert st.previous_month(at("2027-01-01T00:30:00")).text == "2026-12"
    assert not st.is_closed(st.parse_month("2026-12"), at("2027-01-01T00:00:00"))
    assert st.is_closed(st.parse_month("2026-12"), at("2027-01-01T00:00:00") + timedelta(seconds=CLOSE_GRACE_S))


def _tokens(fleet) -> dict[str, str]:
    from app.tokens import create_token
    from ledger import accounts as acc

    with fleet.engine.begin() as conn:
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == "platform:revenue")).scalar_one()
        other = acc.create_account(conn, cmd.CUSTOMER, "someone else")
        return {"customer": create_token(conn, fleet.customer_id, "customer")[1],
                "accountant": create_token(conn, fleet.customer_id, "accountant")[1],
                "owner": create_token(conn, fleet.owner_ids[0], "owner")[1],
                "admin": create_token(conn, platform, "admin")[1],
                "other": create_token(conn, other, "customer")[1]}


def _rows(response) -> list[dict]:
    import csv

    return list(csv.DictReader(io.StringIO(response.text)))


def test_the_ledger_export_totals_match_the_statement(history):
    import httpx

    from tests.support.harness import serving

    fleet, settings = history
    tokens = _tokens(fleet)
    with serving(fleet.database_url, PARALON_INVOICE_DIR=str(settings.storage_dir)) as proxy:
        def get(path: str, token: str) -> httpx.Response:
            return httpx.get(proxy.url + path, headers={"authorization": f"Bearer {token}"}, timeout=60)

        statement = get("/v1/statements/2026-10.json", tokens["accountant"]).json()
        export = get("/v1/exports/ledger.csv?from=2026-10&to=2026-11", tokens["accountant"])
        assert export.status_code == 200 and export.headers["content-type"].startswith("text/csv")
        rows = _rows(export)
        opening, closing = statement["opening_balance_nano_usd"], statement["closing_balance_nano_usd"]
        assert (int(export.headers["x-paralon-opening-balance-nano-usd"]), int(export.headers["x-paralon-closing-balance-nano-usd"])) == (opening, closing)
        assert int(export.headers["x-paralon-postings"]) == len(rows) == sum(s["postings"] for s in statement["sections"]) == 7
        assert opening + sum(int(r["amount_nano_usd"]) for r in rows) == closing == int(rows[-1]["balance_after_nano_usd"])
        by_kind: dict[str, int] = {}
        for r in rows:
            by_kind[r["source_type"]] = by_kind.get(r["source_type"], 0) + int(r["amount_nano_usd"])
        assert by_kind == {s["source_type"]: s["amount_nano_usd"] for s in statement["sections"]}, "per kind, to the nano-dollar"
        assert rows[0]["event_type"] == "RequestSettled" and rows[0]["recorded_at"].startswith("2026-10-01T00:00:00")

        owner_rows = _rows(get("/v1/exports/ledger.csv?from=2026-09-01&to=2026-12", tokens["owner"]))
        assert sum(int(r["amount_nano_usd"]) for r in owner_rows) == fleet.balance(fleet.owner_ids[0]).balance_nano_usd
        assert {r["worker_id"] for r in owner_rows} == {str(fleet.worker_ids[0])}
        settled = [r for r in rows if r["source_type"] == "RequestSettled"]
        assert {r["worker_id"] for r in settled} == {"0"} and {r["api_key_id"] for r in settled} == {str(fleet.key_id)}, \
            "a customer sees its key, never which worker answered"
        assert {r["api_key_id"] for r in owner_rows} == {"0"}, "an owner never sees whose key asked"
        assert _rows(get("/v1/exports/ledger.csv?from=2026-10&to=2026-11", tokens["other"])) == []
        assert get(f"/v1/exports/ledger.csv?from=2026-10&to=2026-11&account_id={fleet.customer_id}", tokens["other"]).status_code == 404, \
            "only an admin names another account"
        assert _rows(get(f"/v1/exports/ledger.csv?from=2026-10&to=2026-11&account_id={fleet.customer_id}", tokens["admin"])) == rows
        for bad in ("from=2026-11&to=2026-10", "from=yesterday", "to=2026-13", "from=2099-01"):
            assert get(f"/v1/exports/ledger.csv?{bad}", tokens["customer"]).status_code == 400, bad

        pdf = get("/v1/statements/2026-10.pdf", tokens["customer"])
        assert pdf.status_code == 200 and pdf.content.startswith(b"%PDF")
        listed = get("/v1/statements", tokens["accountant"]).json()["data"]
        assert [(s["month"], s["closing_balance_nano_usd"]) for s in listed] == [("2026-10", closing)], "a closed month is stored"
        open_month = datetime.now(UTC).strftime("%Y-%m")  # the serve's clock is the real one
        provisional = get(f"/v1/statements/{open_month}.pdf", tokens["customer"])
        assert provisional.status_code == 200 and "provisional" in provisional.headers["content-disposition"]
        assert get("/v1/statements", tokens["accountant"]).json()["data"] == listed, "an open month is not stored"
        owner_statement = get("/v1/statements/2026-10.json", tokens["owner"]).json()
        assert owner_statement["account"]["id"] == fleet.owner_ids[0] and owner_statement["lines"][0]["day"] == "2026-10-01"
        assert get("/v1/statements/2026-10.json", tokens["other"]).status_code == 404, "no activity, nothing to state"
        assert get(f"/v1/statements/2026-10.json?account_id={fleet.customer_id}", tokens["other"]).status_code == 404, \
            "only an admin names another account"
        assert get(f"/v1/statements?account_id={fleet.customer_id}", tokens["other"]).status_code == 404
        assert "pdf_path" not in listed[0], "server paths stay inside"
        assert get("/v1/statements/2026-13.pdf", tokens["customer"]).status_code == 400
        assert get("/v1/statements/2099-01.pdf", tokens["customer"]).status_code == 400
        assert get("/v1/statements/2026-10.txt", tokens["customer"]).status_code == 404
        assert get("/v1/statements/2026-10.pdf", "pt-par-not-a-token").status_code == 401
        as_admin = get(f"/v1/statements/2026-10.json?account_id={fleet.customer_id}", tokens["admin"]).json()
        assert {**as_admin, "generated_at": None} == {**statement, "generated_at": None}
        assert get("/v1/statements/2026-10.json", tokens["admin"]).status_code == 400, "the platform gets no statement"


def test_a_celery_worker_issues_the_month_once_per_account(history, celery_worker):
    fleet, settings = history
    # As the read-model task has done in any running deployment: two first-ever catch-ups at once
    # collide on creating the consumer's position (ledger.log.consume_once), and one task fails.
    read_models.catch_up(fleet.engine)
    worker = celery_worker({"PARALON_DATABASE_URL": fleet.database_url, "PARALON_INVOICE_DIR": str(settings.storage_dir)})
    # Beat fired twice (or a worker died after the first): still one statement each.
    parents = [worker.send(ISSUE_STATEMENTS, month="2026-10") for _ in range(2)]
    for parent in parents:
        worker.result(parent)
    children = [child for parent in parents for child in parent.children or []]
    assert len(children) >= 2, "one task per account, at least from the first run"
    for child in children:  # every task either run started has finished: no duplicate can show later
        worker.result(child)
    with fleet.engine.connect() as conn:
        rows = conn.execute(select(statements.c.account_id, statements.c.closing_balance_nano_usd).order_by(statements.c.account_id)).all()
    assert [tuple(r) for r in rows] == [(fleet.customer_id, OCTOBER_CLOSING), (fleet.owner_ids[0], C2 * 80 // 100 + C1 * 80 // 100)]
    with fleet.engine.connect() as conn:
        stored = conn.execute(select(statements.c.pdf_path, statements.c.pdf_sha256)).all()
    assert all(hashlib.sha256(Path(path).read_bytes()).digest() == digest for path, digest in stored), "each file is the one recorded"
    assert sorted(settings.storage_dir.glob("*/statements/2026-10/*.pdf")) == sorted(Path(path) for path, _ in stored), \
        "a duplicate rendering leaves no file behind"


def test_the_export_pages_through_postings_that_share_one_instant(history, monkeypatch):
    from invoices import exports, read_models

    fleet, _ = history
    same_instant = at("2026-10-25T12:00:00")
    monkeypatch.setattr("ledger.store.utc_now", lambda: same_instant)  # as a group-commit batch stamps its events
    for i in range(5):
        append_now(fleet.engine, cmd.GrantCredits(fleet.customer_id, GB + i, "batch", f"same-{i}"))
    read_models.catch_up(fleet.engine)
    october = st.parse_month("2026-10")
    totals = exports.prepare(fleet.engine, fleet.customer_id, october.start, october.end)

    def export(**page) -> list[list[str]]:
        text = b"".join(exports.csv_chunks(fleet.engine, fleet.customer_id, october.start, october.end, totals, **page)).decode()
        return [line.split(",") for line in text.splitlines()]

    whole = export()
    assert export(page_rows=2) == whole, "pages of two rows give the same rows, none twice, none lost"
    assert len(whole) - 1 == totals.postings == 12
    assert int(whole[-1][whole[0].index("balance_after_nano_usd")]) == totals.closing_balance_nano_usd == OCTOBER_CLOSING + 5 * GB + 10


def test_export_text_cells_never_run_as_spreadsheet_formulas(history):
    import csv

    from invoices import exports, read_models

    fleet, _ = history
    append_now(fleet.engine, cmd.AdjustBalance(fleet.customer_id, GB, "=HYPERLINK(\"http://evil\")", "adj-formula"))
    read_models.catch_up(fleet.engine)
    everything = exports.prepare(fleet.engine, fleet.customer_id, None, datetime.now(UTC))
    text = b"".join(exports.csv_chunks(fleet.engine, fleet.customer_id, None, None, everything)).decode()
    references = [row["reference"] for row in csv.DictReader(io.StringIO(text))]
    assert "'=HYPERLINK(\"http://evil\")" in references and not any(r.startswith("=") for r in references)


def test_the_cli_exports_what_the_api_exports(history, tmp_path):
    import csv

    from invoices import exports

    fleet, _ = history
    env = {"PARALON_DATABASE_URL": fleet.database_url}
    target = tmp_path / "october.csv"
    result = CliRunner().invoke(main, ["ledger", "export", str(fleet.customer_id), "--from", "2026-10", "--to", "2026-11",
                                       "--output", str(target)], env=env)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(target.open()))
    october = st.parse_month("2026-10")
    totals = exports.prepare(fleet.engine, fleet.customer_id, october.start, october.end)
    assert len(rows) == totals.postings == 7 and int(rows[-1]["balance_after_nano_usd"]) == OCTOBER_CLOSING
    assert f"closing {nano_usd_to_usd_text(OCTOBER_CLOSING)} USD" in result.stderr
    for bad in (["--from", "2026-11", "--to", "2026-10"], ["--from", "someday", "--to", "2026-10"]):
        refused = CliRunner().invoke(main, ["ledger", "export", str(fleet.customer_id), *bad, "--output", str(tmp_path / "no.csv")], env=env)
        assert refused.exit_code == 2 and not (tmp_path / "no.csv").exists()
    refused = CliRunner().invoke(main, ["ledger", "export", "999999", "--from", "2026-10", "--to", "2026-11"], env=env)
    assert refused.exit_code == 2 and "does not exist" in refused.stderr


def test_a_month_recorded_into_after_its_statement_stops_the_next(history, monkeypatch):
    """A replica whose clock stepped back records an event into a stated month:
    the next month no longer opens where that one closed, and is not issued."""
    from invoices import read_models

    fleet, settings = history
    september, october = st.parse_month("2026-09"), st.parse_month("2026-10")
    stated = st.issue(fleet.engine, settings, fleet.customer_id, september, statement_labels)
    monkeypatch.setattr("ledger.store.utc_now", lambda: at("2026-09-29T00:00:00"))
    append_now(fleet.engine, cmd.GrantCredits(fleet.customer_id, GB, "late", "late-1"))
    read_models.catch_up(fleet.engine)
    with pytest.raises(InvariantBroken, match="2026-09 was stated closing at"):
        st.issue(fleet.engine, settings, fleet.customer_id, october, statement_labels)
    with fleet.engine.connect() as conn:
        assert [s["month"] for s in st.list_statements(conn, fleet.customer_id)] == ["2026-09"]
    assert stated["closing_balance_nano_usd"] == SEPTEMBER_CLOSING
