"""`GET` and `PUT /v1/account/low-balance-alert`: a customer sets its own
threshold (two decimals at most, above zero; null turns it off), readers see
it, and another account's is not there for them (404, nothing written)."""
from __future__ import annotations

import json

from click.testing import CliRunner

from app.cli import main

PATH = "/v1/account/low-balance-alert"


def _threshold(site, account_id: int) -> int | None:
    from sqlalchemy import select

    from ledger.schema import accounts

    with site.engine.connect() as conn:
        return conn.execute(select(accounts.c.low_balance_threshold_nano_usd).where(accounts.c.id == account_id)).scalar()


def test_a_customer_sets_reads_and_turns_off_its_own_alert(site):
    assert site.call("GET", PATH, site.tokens["customer"]).json()["threshold_usd"] is None
    response = site.call("PUT", PATH, site.tokens["customer"], json={"threshold_usd": "2.00"})
    assert response.status_code == 200
    shown = response.json()
    assert (shown["account_id"], shown["threshold_usd"], shown["threshold_nano_usd"]) == (site.customer_id, "2.00", 2_000_000_000)
    assert shown["below"] is False and shown["alerted_at"] is None, "$10 of credits"
    assert site.call("GET", PATH, site.tokens["accountant"]).json()["threshold_usd"] == "2.00"
    assert site.call("GET", f"{PATH}?account_id={site.customer_id}", site.tokens["admin"]).json()["threshold_usd"] == "2.00"
    assert site.call("PUT", PATH, site.tokens["customer"], json={"threshold_usd": "12.5"}).json()["threshold_usd"] == "12.50"
    assert site.call("PUT", PATH, site.tokens["customer"], json={"threshold_usd": None}).json()["threshold_usd"] is None
    assert _threshold(site, site.customer_id) is None


def test_another_account_cannot_set_or_read_it(site):
    site.call("PUT", PATH, site.tokens["customer"], json={"threshold_usd": "2.00"})
    foreign = f"{PATH}?account_id={site.customer_id}"
    assert site.call("PUT", foreign, site.tokens["other_customer"], json={"threshold_usd": "9.00"}).status_code == 404
    assert site.call("GET", foreign, site.tokens["other_customer"]).status_code == 404
    assert site.call("GET", PATH, site.tokens["other_customer"]).json()["threshold_usd"] is None, "its own"
    for role in ("accountant", "owner", "admin"):  # only a customer sets it
        assert site.call("PUT", PATH, site.tokens[role], json={"threshold_usd": "9.00"}).status_code == 403
    assert site.call("PUT", PATH, None, json={"threshold_usd": "9.00"}).status_code == 401
    assert _threshold(site, site.customer_id) == 2_000_000_000 and _threshold(site, site.other_customer_id) is None


def test_bad_thresholds_are_400_and_write_nothing(site_each_storage):
    site = site_each_storage
    site.call("PUT", PATH, site.tokens["customer"], json={"threshold_usd": "2.00"})
    before = site.money()
    bodies = [{"threshold_usd": bad} for bad in ("-1", "-0.50", "0", "2.001", "1e2", " 2", "", "2\x00", 2, 2.5, True, ["2"])]
    for body in [*bodies, {}, {"threshold": "2.00"}, ["2.00"], "2.00"]:
        response = site.call("PUT", PATH, site.tokens["customer"], json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["message"]
    not_json = site.call("PUT", PATH, site.tokens["customer"], content=b"{nope")
    assert not_json.status_code == 400
    assert _threshold(site, site.customer_id) == 2_000_000_000 and site.money() == before


def test_the_command_sets_shows_and_turns_it_off(site):
    url = str(site.engine.url.render_as_string(hide_password=False))

    def run(*args: str, code: int = 0) -> dict:
        result = CliRunner().invoke(main, ["accounts", "low-balance-alert", *args, "--json"],
                                    env={"PARALON_DATABASE_URL": url}, catch_exceptions=False)
        assert result.exit_code == code, result.output
        return json.loads(result.output if code == 0 else result.stderr)

    assert run(str(site.customer_id), "--threshold-usd", "2.00")["threshold_nano_usd"] == 2_000_000_000
    assert run(str(site.customer_id))["threshold_usd"] == "2.00"
    assert run(str(site.customer_id), "--threshold-usd", "-1", code=2)["error"]["code"] == "invalid_amount"
    assert run(str(site.owner_id), "--threshold-usd", "2.00", code=2)["error"]["message"]
    assert run(str(site.customer_id), "--off", "--threshold-usd", "2.00", code=2)["error"]["code"] == "invalid_input"
    assert run(str(site.customer_id))["threshold_usd"] == "2.00", "nothing written by the refusals"
    assert run(str(site.customer_id), "--off")["threshold_usd"] is None
