"""Reconciliation: opening balance + what moved it by kind = closing balance,
to the nano-dollar, equal to the monthly statements' figures and to the ledger
export's rows and balances for the same months (the history of
tests/invoices/test_statements.py: grants, top-ups, usage across a month
boundary, a refund, a dispute won, a reversed request, an adjustment). A read
model (the postings and their sums per day) changed after its month's
statement was stored, or a posting no figure names, is reported as not
balanced; nothing a reconciliation does moves money."""
from __future__ import annotations

import csv
import io
import json

import pytest
from click.testing import CliRunner
from sqlalchemy import select, update

from app.cli import main
from app.statement_labels import statement_labels
from invoices import exports
from invoices import reconciliation as rec
from invoices import statements as st
from invoices.schema import account_postings, postings_daily
from ledger.errors import InvalidInput, UnknownAccount, WrongAccountKind
from ledger.schema import accounts
from tests.invoices.test_statements import GB, OCTOBER_CLOSING, SEPTEMBER_CLOSING, at, history  # noqa: F401 (a fixture)
from tests.ledger.helpers import money_snapshot

NOW = at("2026-11-02T10:00:00")  # November is open, as in the history's clock


@pytest.fixture
def clocked(history, monkeypatch):  # noqa: F811 (the fixture)
    monkeypatch.setattr("invoices.reconciliation.utc_now", lambda: NOW)
    return history


def _months(first: str, after: str) -> tuple[st.Month, st.Month]:
    return st.parse_month(first), st.parse_month(after)


def _statement_figures(fleet, settings, account_id: int, month: str) -> dict:
    return st.figures(fleet.engine, settings, account_id, st.parse_month(month), statement_labels, now=NOW)


def _csv(fleet, account_id: int, first: str, after: str, through_seq: int) -> tuple[exports.ExportTotals, list[dict]]:
    start, end = st.parse_month(first).start, st.parse_month(after).start
    totals = exports.totals(fleet.engine, account_id, start, end, through_seq)
    text = b"".join(exports.csv_chunks(fleet.engine, account_id, start, end, totals)).decode()
    return totals, list(csv.DictReader(io.StringIO(text)))


def _by_figure(kind: str, amounts_by_source: dict[str, int]) -> dict[str, int]:
    names = {**rec.FIGURE_OF_SOURCE, st.SETTLED: rec.SETTLED_FIGURE[kind]}
    figures = dict.fromkeys(names.values(), 0)
    for source_type, amount in amounts_by_source.items():
        figures[names[source_type]] += amount
    return figures


def _figures_of(reconciled: dict) -> dict[str, int]:
    skip = ("opening_balance_nano_usd", "closing_balance_nano_usd")
    return {k: v for k, v in reconciled.items() if k.endswith("_nano_usd") and k not in skip}


def test_a_month_reconciles_as_its_statement_and_its_export_say(clocked):
    fleet, settings = clocked
    before = money_snapshot(fleet.engine)
    october = rec.reconcile(fleet.engine, fleet.customer_id, *_months("2026-10", "2026-11"))
    assert october["balanced"] and october["problems"] == [] and not october["provisional"]
    assert (october["opening_balance_nano_usd"], october["closing_balance_nano_usd"]) == (SEPTEMBER_CLOSING, OCTOBER_CLOSING)
    assert october["refunds_nano_usd"] == -5 * GB and october["adjustments_nano_usd"] == GB
    assert october["disputes_nano_usd"] == 0, "a dispute won gives back what it froze"
    assert october["opening_balance_nano_usd"] + sum(_figures_of(october).values()) == october["closing_balance_nano_usd"]

    statement = _statement_figures(fleet, settings, fleet.customer_id, "2026-10")
    assert (statement["opening_balance_nano_usd"], statement["closing_balance_nano_usd"]) == \
        (october["opening_balance_nano_usd"], october["closing_balance_nano_usd"])
    assert _figures_of(october) == _by_figure("customer", {s["source_type"]: s["amount_nano_usd"] for s in statement["sections"]})
    assert october["postings"] == sum(s["postings"] for s in statement["sections"])

    totals, rows = _csv(fleet, fleet.customer_id, "2026-10", "2026-11", october["through_seq"])
    assert (totals.opening_balance_nano_usd, totals.closing_balance_nano_usd, totals.postings) == \
        (october["opening_balance_nano_usd"], october["closing_balance_nano_usd"], october["postings"]) == \
        (october["opening_balance_nano_usd"], int(rows[-1]["balance_after_nano_usd"]), len(rows))
    by_source: dict[str, int] = {}
    for row in rows:
        by_source[row["source_type"]] = by_source.get(row["source_type"], 0) + int(row["amount_nano_usd"])
    assert _figures_of(october) == _by_figure("customer", by_source)
    assert money_snapshot(fleet.engine) == before


def test_several_months_and_an_owner_reconcile_too(clocked):
    fleet, settings = clocked
    whole = rec.reconcile(fleet.engine, fleet.customer_id, *_months("2026-09", "2026-12"))
    assert whole["balanced"] and whole["provisional"], "November is still open"
    assert whole["opening_balance_nano_usd"] == 0
    assert whole["closing_balance_nano_usd"] == fleet.balance(fleet.customer_id).balance_nano_usd
    assert (whole["top_ups_nano_usd"], whole["credits_granted_nano_usd"]) == (25 * GB, 10 * GB)
    monthly = [_statement_figures(fleet, settings, fleet.customer_id, m) for m in ("2026-09", "2026-10", "2026-11")]
    summed: dict[str, int] = {}
    for statement in monthly:
        for section in statement["sections"]:
            summed[section["source_type"]] = summed.get(section["source_type"], 0) + section["amount_nano_usd"]
    assert _figures_of(whole) == _by_figure("customer", summed), "the months' statements add up to the period"
    assert whole["closing_balance_nano_usd"] == monthly[-1]["closing_balance_nano_usd"]

    owner = fleet.owner_ids[0]
    earned = rec.reconcile(fleet.engine, owner, *_months("2026-09", "2026-12"))
    assert earned["balanced"] and earned["kind"] == "owner" and "usage_nano_usd" not in earned
    assert earned["earnings_nano_usd"] == earned["closing_balance_nano_usd"] == fleet.balance(owner).balance_nano_usd
    october = rec.reconcile(fleet.engine, owner, *_months("2026-10", "2026-11"))
    owner_statement = _statement_figures(fleet, settings, owner, "2026-10")
    assert october["earnings_nano_usd"] == sum(s["amount_nano_usd"] for s in owner_statement["sections"])


def test_a_changed_read_model_or_an_unnamed_posting_does_not_balance(clocked):
    fleet, settings = clocked
    months = _months("2026-10", "2026-11")
    st.issue(fleet.engine, settings, fleet.customer_id, months[0], statement_labels, now=NOW)
    assert rec.reconcile(fleet.engine, fleet.customer_id, *months)["statements_checked"] == ["2026-10"]
    before = money_snapshot(fleet.engine)
    ap, pd = account_postings.c, postings_daily.c
    with fleet.engine.begin() as conn:  # the read model's refund is one nano-dollar smaller than the statement stated
        refund = conn.execute(select(ap.event_seq, ap.leg, ap.recorded_at).where(ap.account_id == fleet.customer_id,
                                                                                 ap.source_type == "CreditsRefunded")).one()
        conn.execute(update(account_postings).where(ap.account_id == fleet.customer_id, ap.event_seq == refund.event_seq)
                     .values(amount_nano_usd=ap.amount_nano_usd + 1))
        conn.execute(update(postings_daily).where(pd.account_id == fleet.customer_id, pd.source_type == "CreditsRefunded",
                                                  pd.day == refund.recorded_at.date().isoformat())
                     .values(amount_nano_usd=pd.amount_nano_usd + 1))  # its sums per day, kept with it
    changed = rec.reconcile(fleet.engine, fleet.customer_id, *months)
    assert not changed["balanced"] and changed["refunds_nano_usd"] == -5 * GB + 1
    assert [p for p in changed["problems"] if "stored statement of 2026-10" in p], changed["problems"]

    with fleet.engine.begin() as conn:  # a posting of a kind no figure names: counted in the balances, in no figure
        conn.execute(account_postings.insert().values(
            account_id=fleet.customer_id, event_seq=refund.event_seq, leg=refund.leg + 100, recorded_at=at("2026-10-06T00:00:00"),
            event_type="Mystery", source_type="Mystery", amount_nano_usd=7, model="", api_key_id=0, worker_id=0, reference=""))
        conn.execute(postings_daily.insert().values(account_id=fleet.customer_id, day="2026-10-06", source_type="Mystery",
                                                    postings=1, amount_nano_usd=7))
    unnamed = rec.reconcile(fleet.engine, fleet.customer_id, *months)
    assert not unnamed["balanced"]
    assert [p for p in unnamed["problems"] if "Mystery" in p] and [p for p in unnamed["problems"] if "is not the closing" in p]
    assert money_snapshot(fleet.engine) == before, "the ledger itself is untouched"


def test_periods_and_accounts_that_cannot_reconcile_are_refused(clocked):
    fleet, _ = clocked
    with fleet.engine.connect() as conn:
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == "platform:revenue")).scalar_one()
    before = money_snapshot(fleet.engine)
    refusals = [
        (InvalidInput, ("2026-10", "2026-10")),  # no month at all
        (InvalidInput, ("2026-11", "2026-10")),
        (InvalidInput, ("2026-12", "2027-01")),  # not begun
    ]
    for error, (first, after) in refusals:
        with pytest.raises(error):
            rec.reconcile(fleet.engine, fleet.customer_id, *_months(first, after))
    with pytest.raises(WrongAccountKind):
        rec.reconcile(fleet.engine, platform, *_months("2026-10", "2026-11"))
    with pytest.raises(UnknownAccount):
        rec.reconcile(fleet.engine, 10**9, *_months("2026-10", "2026-11"))
    assert money_snapshot(fleet.engine) == before


def test_the_cli_reconciles_as_the_service_does(clocked):
    fleet, settings = clocked
    env = {"PARALON_DATABASE_URL": fleet.database_url, "PARALON_INVOICE_DIR": str(settings.storage_dir)}

    def run(*args: str, expect: int):
        result = CliRunner().invoke(main, ["ledger", "reconcile", *args], env=env)
        assert result.exit_code == expect, result.output
        return result

    shown = json.loads(run(str(fleet.customer_id), "--from", "2026-10", "--to", "2026-11", "--json", expect=0).stdout)
    assert shown == rec.reconcile(fleet.engine, fleet.customer_id, *_months("2026-10", "2026-11"))
    text = run(str(fleet.customer_id), "--from", "2026-10", "--to", "2026-11", expect=0).stdout
    assert "refunds: -5.00" in text and text.rstrip().endswith("balanced")
    for bad in (["--from", "2026-13", "--to", "2026-11"], ["--from", "2026-11", "--to", "2026-10"]):
        assert json.loads(run(str(fleet.customer_id), *bad, "--json", expect=2).stderr)["error"]["code"] == "invalid_input"
    with fleet.engine.begin() as conn:
        for table in (account_postings, postings_daily):  # the postings, and their sums per day
            conn.execute(update(table).where(table.c.account_id == fleet.customer_id, table.c.source_type == "CreditsRefunded")
                         .values(source_type="Mystery"))
    unbalanced = run(str(fleet.customer_id), "--from", "2026-10", "--to", "2026-11", expect=1).stdout
    assert "NOT BALANCED" in unbalanced and "Mystery" in unbalanced
