"""The accountant's and the admin's routes at the HTTP edge, on the real app:
a period's reconciliation (equal to the export's balances and the statement's
figures), a period's documents as a zip, the platform's status and the list
of every account. Each is scoped like the rest of the management API: another
account's data answers 404, a role that may not answers 403, a bad period
400, and none of it moves money. The CLI says what the API says."""
from __future__ import annotations

import json
from datetime import UTC, datetime

from click.testing import CliRunner

from app.cli import main
from app.jobs.ledger_check import run_verification
from invoices import read_models
from invoices.statements import previous_month
from ledger.schema import utc_now

EVERY_MONTH = "from=2000-01"


def _next_month() -> str:
    now = utc_now()
    return datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC).strftime("%Y-%m")


def _this_month() -> str:
    return utc_now().strftime("%Y-%m")


def test_a_reconciliation_balances_and_equals_the_export_and_the_statement(site):
    before = site.money()
    period = f"{EVERY_MONTH}&to={_next_month()}"
    reconciled = site.call("GET", f"/v1/reconciliation?{period}", site.tokens["accountant"])
    assert reconciled.status_code == 200, reconciled.text
    figures = reconciled.json()
    assert figures["balanced"] and figures["problems"] == [] and figures["provisional"]
    assert figures["opening_balance_nano_usd"] == 0
    assert figures["credits_granted_nano_usd"] == 10 * 10**9 and figures["usage_nano_usd"] == -3_000
    assert figures["closing_balance_nano_usd"] == site.money()["balances"][site.customer_id]
    read_models.catch_up(site.engine)
    assert figures["through_seq"] == site.money()["events"], "it stands at the newest event"

    export = site.call("GET", f"/v1/exports/ledger.csv?{period}", site.tokens["accountant"])
    assert (int(export.headers["x-paralon-opening-balance-nano-usd"]), int(export.headers["x-paralon-closing-balance-nano-usd"]),
            int(export.headers["x-paralon-postings"]), int(export.headers["x-paralon-through-seq"])) == \
        (figures["opening_balance_nano_usd"], figures["closing_balance_nano_usd"], figures["postings"], figures["through_seq"])
    month = site.call("GET", f"/v1/reconciliation?from={_this_month()}&to={_next_month()}", site.tokens["customer"]).json()
    statement = site.call("GET", f"/v1/statements/{_this_month()}.json", site.tokens["customer"]).json()
    assert (month["opening_balance_nano_usd"], month["closing_balance_nano_usd"]) == \
        (statement["opening_balance_nano_usd"], statement["closing_balance_nano_usd"])
    sections = {s["source_type"]: s["amount_nano_usd"] for s in statement["sections"]}
    assert (month["credits_granted_nano_usd"], month["usage_nano_usd"]) == \
        (sections.get("CreditsGranted", 0), sections.get("RequestSettled", 0))

    owner = site.call("GET", f"/v1/reconciliation?{period}", site.tokens["owner"]).json()
    assert owner["balanced"] and owner["earnings_nano_usd"] == site.money()["balances"][site.owner_id] > 0
    as_admin = site.call("GET", f"/v1/reconciliation?{period}&account_id={site.customer_id}", site.tokens["admin"]).json()
    assert as_admin == figures
    assert site.money() == before


def test_a_reconciliation_is_scoped_and_refuses_bad_periods(site):
    before = site.money()
    period = f"{EVERY_MONTH}&to={_next_month()}"
    foreign = site.call("GET", f"/v1/reconciliation?{period}&account_id={site.customer_id}", site.tokens["other_customer"])
    assert foreign.status_code == 404, "another account's figures are not there for a customer"
    assert site.call("GET", f"/v1/reconciliation?{period}&account_id={site.customer_id}", site.tokens["owner"]).status_code == 404
    assert site.call("GET", f"/v1/reconciliation?{period}", site.tokens["admin"]).status_code == 400, "the platform has no statement"
    assert site.call("GET", f"/v1/reconciliation?{period}", site.tokens["revoked"]).status_code == 401
    last_month = previous_month(utc_now()).text
    cases = {f"from=2026-13&to={_next_month()}": "from", "from=2026-10&to=2026-1": "to", "from=2026-10-01&to=2026-11": "from",
             f"from={_this_month()}&to={_this_month()}": "to", f"from={_this_month()}&to={last_month}": "to",
             "from=2999-01&to=2999-02": "from", f"to={_next_month()}": None, EVERY_MONTH: None}
    for query, param in cases.items():
        refused = site.call("GET", f"/v1/reconciliation?{query}", site.tokens["accountant"])
        assert refused.status_code == 400, (query, refused.text)
        if param:
            assert refused.json()["error"]["param"] == param, (query, refused.json())
    assert site.money() == before


def test_the_zip_route_is_scoped_and_refuses_bad_periods(site):
    before = site.money()
    assert site.call("GET", "/v1/invoices.zip?from=2026-10&to=2026-11", site.tokens["owner"]).status_code == 403
    assert site.call("GET", f"/v1/invoices.zip?from=2026-10&to=2026-11&account_id={site.customer_id}",
                     site.tokens["other_customer"]).status_code == 404
    empty = site.call("GET", "/v1/invoices.zip?from=2026-10&to=2026-11", site.tokens["accountant"])
    assert empty.status_code == 200 and empty.content.startswith(b"PK")
    for query in ("from=2026-11&to=2026-10", "from=2026-10&to=2026-10", "from=nope&to=2026-11", "from=2026-10",
                  "to=2026-11", "from=&to=2026-11", "from=2026-10&to=2026-11&kind=receipt", "from=2026-10&to=2026-11&kind="):
        refused = site.call("GET", f"/v1/invoices.zip?{query}", site.tokens["customer"])
        assert refused.status_code == 400, (query, refused.text)
    assert site.money() == before


def test_the_platform_status_is_for_admins(site):
    for role in ("customer", "accountant", "owner"):
        assert site.call("GET", "/v1/platform/status", site.tokens[role]).status_code == 403, role
        assert site.call("GET", "/v1/accounts", site.tokens[role]).status_code == 403, role
    assert site.call("GET", "/v1/platform/status").status_code == 401
    status = site.call("GET", "/v1/platform/status", site.tokens["admin"]).json()
    assert status["ledger_verify"] == {"ok": None, "verified_seq": 0, "checked_at": None, "problems_total": 0,
                                       "first_problem": None}, "no scheduled verification has run"
    assert status["accounts_by_kind"]["customer"] == 2 and status["accounts_by_kind"]["owner"] == 2
    assert status["accounts_by_kind"]["platform"] >= 1
    assert status["workers_by_state"] == {"active": 2, "draining": 0, "drained": 0, "suspended": 0, "active_healthy": 0}
    assert status["projections"]["lag_events"] == site.money()["events"] - _applied(site), "events not applied yet"

    read_models.catch_up(site.engine)
    verified = run_verification(site.engine)
    site.call("POST", f"/v1/workers/{site.worker_id}/drain", site.tokens["owner"])
    status = site.call("GET", "/v1/platform/status", site.tokens["admin"]).json()
    assert status["projections"]["lag_events"] == 0
    assert status["ledger_verify"]["ok"] is True and status["ledger_verify"]["verified_seq"] == verified["verified_seq"] > 0
    assert status["ledger_verify"]["checked_at"] is not None
    assert status["workers_by_state"]["draining"] == 1 and status["workers_by_state"]["active"] == 1


def _applied(site) -> int:
    from ledger.log import consumer_position

    with site.engine.connect() as conn:
        return consumer_position(conn, read_models.CONSUMER)


def test_every_account_is_listed_a_page_at_a_time_for_admins(site):
    before = site.money()
    admin = site.tokens["admin"]
    listed = site.call("GET", "/v1/accounts", admin).json()
    assert listed["next_after_id"] is None
    by_id = {a["id"]: a for a in listed["data"]}
    assert sorted(by_id) == sorted(before["balances"]), "every account, the platform's own too"
    assert {a: v["balance_nano_usd"] for a, v in by_id.items()} == before["balances"]
    customer = by_id[site.customer_id]
    assert (customer["kind"], customer["name"], customer["held_nano_usd"]) == ("customer", "Ada", 0)
    assert customer["available_nano_usd"] == customer["balance_nano_usd"] == 10 * 10**9 - 3_000

    pages, after = [], 0
    while after is not None:
        page = site.call("GET", f"/v1/accounts?limit=2&after_id={after}", admin).json()
        assert len(page["data"]) <= 2
        pages += page["data"]
        after = page["next_after_id"]
    assert pages == listed["data"]
    for query in ("limit=0", "limit=1001", "after_id=-1", "limit=two"):
        assert site.call("GET", f"/v1/accounts?{query}", admin).status_code == 400, query
    assert site.money() == before


def test_the_cli_shows_what_the_api_shows(site):
    env = {"PARALON_DATABASE_URL": site.engine.url.render_as_string(hide_password=False)}

    def run(*args: str) -> dict:
        result = CliRunner().invoke(main, [*args, "--json"], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    status = site.call("GET", "/v1/platform/status", site.tokens["admin"]).json()
    shown = run("platform", "status")
    assert {**shown, "projections": None} == {**status, "projections": None}
    assert shown["projections"]["lag_events"] == status["projections"]["lag_events"]
    assert run("accounts", "list") == site.call("GET", "/v1/accounts", site.tokens["admin"]).json()
    assert run("accounts", "list", "--limit", "1", "--after-id", str(site.customer_id - 1))["data"][0]["id"] == site.customer_id
    text = CliRunner().invoke(main, ["platform", "status"], env=env).output
    assert "ledger verify: not run yet" in text and "workers: active 2" in text
