"""The `paralon` command line, on SQLite and on PostgreSQL."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from app.cli import main
from ledger.db import make_engine
from tests.ledger.helpers import money_snapshot
from tests.support.db_roles import app_role_url


@pytest.fixture
def paralon(database_url):
    runner = CliRunner()

    def run(*args, expect: int = 0):
        result = runner.invoke(main, list(args), env={"PARALON_DATABASE_URL": database_url}, catch_exceptions=False)
        assert result.exit_code == expect, (result.output, result.stderr)
        return result

    run("migrate", "--json")
    return run


def _json(result) -> dict:
    return json.loads(result.stdout)


def test_create_grant_and_read_a_balance(paralon):
    customer = _json(paralon("accounts", "create", "--kind", "customer", "--name", "Ada", "--email", "ada@example.com", "--json"))["id"]
    owner = _json(paralon("accounts", "create", "--kind", "owner", "--name", "GPU farm", "--json"))["id"]
    granted = _json(paralon("credits", "grant", str(customer), "--usd", "12.50", "--reason", "welcome", "--json"))
    assert granted["status"] == "created"
    balance = _json(paralon("balance", str(customer), "--json"))
    assert balance["available_nano_usd"] == 12_500_000_000
    assert balance["held_nano_usd"] == 0
    assert _json(paralon("balance", str(owner), "--json"))["earnings_nano_usd"] == 0


def test_ledger_verify_and_replay(paralon, database_url):
    customer = _json(paralon("accounts", "create", "--kind", "customer", "--name", "Ada", "--json"))["id"]
    paralon("credits", "grant", str(customer), "--usd", "1", "--reason", "x", "--json")
    report = _json(paralon("ledger", "verify", "--json"))
    assert report["ok"] and report["events_checked"] == 1
    replay = paralon("ledger", "replay", "--json")
    assert _json(replay)["events_replayed"] == 1
    assert "replaying" in replay.stderr  # the progress bar
    engine = make_engine(database_url)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":  # a superuser's edit: the balance guard (migration 0013) is off for it
            conn.execute(text("SET LOCAL session_replication_role = replica"))
        conn.execute(text("UPDATE account_balances SET balance_nano_usd = balance_nano_usd + 5"))
    failed = paralon("ledger", "verify", expect=1)
    assert "differs by 5" in failed.stdout
    paralon("ledger", "replay", "--json")  # as the owner role, it rewrites the balances from the log
    paralon("ledger", "verify", "--json")
    engine.dispose()


@pytest.mark.parametrize(
    "args, code",
    [
        (["--usd", "0"], "invalid_amount"),
        (["--usd", "-3"], "invalid_amount"),
        (["--usd", "abc"], "invalid_amount"),
        (["--usd", "1.0000000001"], "invalid_amount"),
        (["--usd", "5", "--idempotency-key", "grant-1"], "exists_with_different_content"),
    ],
)
def test_bad_grants_are_refused_and_write_nothing(paralon, database_url, args, code):
    customer = _json(paralon("accounts", "create", "--kind", "customer", "--name", "Ada", "--json"))["id"]
    paralon("credits", "grant", str(customer), "--usd", "2", "--reason", "first", "--idempotency-key", "grant-1", "--json")
    engine = make_engine(database_url)
    before = money_snapshot(engine)
    failed = paralon("credits", "grant", str(customer), *args, "--reason", "again", "--json", expect=2)
    assert json.loads(failed.stderr)["error"]["code"] == code
    assert money_snapshot(engine) == before
    engine.dispose()


def test_unknown_account_and_overdraft_are_refused(paralon, database_url):
    customer = _json(paralon("accounts", "create", "--kind", "customer", "--name", "Ada", "--json"))["id"]
    engine = make_engine(database_url)
    before = money_snapshot(engine)
    assert "does not exist" in paralon("credits", "grant", "99999", "--usd", "1", "--reason", "x", expect=2).stderr
    assert "below zero" in paralon("credits", "adjust", str(customer), "--usd", "-1", "--reason", "x", expect=2).stderr
    assert "does not exist" in paralon("balance", "99999", expect=2).stderr
    assert money_snapshot(engine) == before
    engine.dispose()


@pytest.mark.parametrize("url", ["not a url", "mysql://localhost/x", "postgresql://localhost", "sqlite://"])
def test_a_malformed_database_url_is_a_clear_error(url):
    result = CliRunner().invoke(main, ["balance", "1", "--json"], env={"PARALON_DATABASE_URL": url})
    assert result.exit_code == 2
    error = json.loads(result.stderr)["error"]
    assert error["code"] == "bad_database_url" or "database" in error["message"]


def test_the_console_script_runs(tmp_path):
    env = dict(os.environ, PARALON_DATABASE_URL=f"sqlite:///{tmp_path}/cli.db")
    paralon = Path(sys.executable).parent / "paralon"
    out = subprocess.run([str(paralon), "migrate", "--json"], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"revision": "head"}


def test_postings_move_into_their_event_row_and_back_as_the_owner_only(paralon, database_url):
    customer = _json(paralon("accounts", "create", "--kind", "customer", "--name", "Ada", "--json"))["id"]
    if not database_url.startswith("postgresql"):
        refused = paralon("ledger", "postings-in-event-row", "on", "--json", expect=2)
        assert "only PostgreSQL" in json.loads(refused.stderr)["error"]["message"]
        return
    engine = make_engine(database_url)
    service = CliRunner().invoke(main, ["ledger", "postings-in-event-row", "on", "--json"],
                                 env={"PARALON_DATABASE_URL": app_role_url(database_url)}, catch_exceptions=False)
    assert (service.exit_code, json.loads(service.stderr)["error"]["code"]) == (2, "not_the_owner")
    assert _layout(engine) == (False, 0, 0), "nothing written"
    assert _json(paralon("ledger", "postings-in-event-row", "on", "--json")) == {"postings_in_event_row": True, "was": False}
    paralon("credits", "grant", str(customer), "--usd", "2", "--reason", "in the row", "--json")
    assert _layout(engine) == (True, 1, 0), "its two legs are in the event's row, no posting row"
    assert "already so" in paralon("ledger", "postings-in-event-row", "on").stdout
    assert _json(paralon("ledger", "postings-in-event-row", "off", "--json")) == {"postings_in_event_row": False, "was": True}
    paralon("credits", "grant", str(customer), "--usd", "3", "--reason", "as rows", "--json")
    assert _layout(engine) == (False, 1, 2)
    assert _json(paralon("balance", str(customer), "--json"))["available_nano_usd"] == 5 * 10**9
    report = _json(paralon("ledger", "verify", "--json"))
    assert report["ok"] and report["events_checked"] == 2
    engine.dispose()


def _layout(engine) -> tuple[bool, int, int]:
    """The head's flag, the events carrying their postings, the posting rows."""
    with engine.connect() as conn:
        return tuple(conn.execute(text("SELECT (SELECT postings_in_event_row FROM ledger_head), "
                                 "(SELECT count(*) FROM ledger_events WHERE posting_account_ids IS NOT NULL), "
                                 "(SELECT count(*) FROM ledger_postings)")).one())
