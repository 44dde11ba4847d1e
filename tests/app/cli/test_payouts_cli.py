"""`paralon payouts`: an operator sets where an owner is paid, asks for a payout,
lists it and asks again for a failed one; bad input exits 2 with nothing written."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from app.cli import main
from app.payments import payouts as po
from ledger.db import make_engine
from tests.ledger.helpers import money_snapshot

ADDRESS = "0x00000000000000000000000000000000000000A1"


@pytest.fixture
def paralon(database_url):
    runner = CliRunner()

    def run(*args: str, expect: int = 0) -> dict:
        result = runner.invoke(main, [*args, "--json"], env={"PARALON_DATABASE_URL": database_url}, catch_exceptions=False)
        assert result.exit_code == expect, (result.stdout, result.stderr)
        return json.loads(result.stdout if expect == 0 else result.stderr)

    run("migrate")
    return run


def test_an_operator_pays_an_owner_out_and_asks_again_after_a_failure(paralon, database_url):
    owner = paralon("accounts", "create", "--kind", "owner", "--name", "GPU farm")["id"]
    paralon("credits", "adjust", str(owner), "--usd", "50", "--reason", "earnings")
    assert paralon("payouts", "destination", "set", str(owner), "--address", ADDRESS.lower())["destination"] == ADDRESS
    assert paralon("payouts", "stripe-account", "set", str(owner), "--account", "acct_1Farm")["changed"] is False

    payout = paralon("payouts", "request", str(owner), "--usd", "20.5", "--rail", "usdc")
    assert (payout["state"], payout["amount_nano_usd"], payout["destination"]) == ("requested", 20_500_000_000, ADDRESS)
    assert paralon("payouts", "retry", str(payout["id"]), expect=2)["error"]["code"] == "invalid_input"
    engine = make_engine(database_url)
    with engine.begin() as conn:
        po.fail(conn, payout["id"], "refused by the rail")
    again = paralon("payouts", "retry", str(payout["id"]))
    assert again["id"] != payout["id"] and again["amount_nano_usd"] == payout["amount_nano_usd"]
    listed = paralon("payouts", "list", str(owner))["data"]
    assert [(p["id"], p["state"]) for p in listed] == [(again["id"], "requested"), (payout["id"], "failed")]
    engine.dispose()


@pytest.mark.parametrize("args", [
    ("payouts", "request", "{owner}", "--usd", "5", "--rail", "usdc"),
    ("payouts", "request", "{owner}", "--usd", "500", "--rail", "usdc"),
    ("payouts", "request", "{owner}", "--usd", "twenty", "--rail", "usdc"),
    ("payouts", "request", "{owner}", "--usd", "20", "--rail", "stripe"),
    ("payouts", "destination", "set", "{owner}", "--address", "0x1234"),
    ("payouts", "stripe-account", "set", "{owner}", "--account", "0x1234"),
    ("payouts", "retry", "999"),
])
def test_bad_input_exits_2_and_writes_nothing(paralon, database_url, args):
    owner = paralon("accounts", "create", "--kind", "owner", "--name", "GPU farm")["id"]
    paralon("credits", "adjust", str(owner), "--usd", "50", "--reason", "earnings")
    paralon("payouts", "destination", "set", str(owner), "--address", ADDRESS)
    engine = make_engine(database_url)
    before = money_snapshot(engine)
    paralon(*(arg.format(owner=owner) for arg in args), expect=2)
    assert money_snapshot(engine) == before
    engine.dispose()
