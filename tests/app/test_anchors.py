"""Anchors: the head of the chain written where the database cannot rewrite it
(an append-only file, an EVM transaction), and `ledger verify` checking the
chain against every anchor it can read. The attack: delete the last event,
rewind `ledger_head`, replay the balances; without anchors `verify` is clean."""
from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select, text

from app.cli import main
from app.jobs.celery import celery
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.db import is_postgres, make_engine
from ledger.schema import ledger_events, ledger_head
from ledger.service import append_now
from tests.ledger.helpers import money_snapshot
from tests.support.anvil import running_anvil
from tests.support.harness import free_port

USD = 10**9


@pytest.fixture
def anchor_file(tmp_path) -> Path:
    return tmp_path / "anchors.jsonl"


@pytest.fixture
def paralon(database_url, anchor_file):
    runner = CliRunner()
    env = {"PARALON_DATABASE_URL": database_url, "PARALON_ANCHOR_FILE": str(anchor_file)}

    def run(*args, expect: int = 0, **more_env: str):
        result = runner.invoke(main, list(args), env={**env, **more_env}, catch_exceptions=False)
        assert result.exit_code == expect, (result.output, result.stderr)
        return result

    run("migrate", "--json")
    return run


def _json(result) -> dict:
    return json.loads(result.stdout)


def _customer_with_grants(paralon, grants: int) -> int:
    customer = _json(paralon("accounts", "create", "--kind", "customer", "--name", "Ada", "--json"))["id"]
    for i in range(grants):
        paralon("credits", "grant", str(customer), "--usd", str(i + 1), "--reason", f"grant {i}", "--json")
    return customer


def _head(engine) -> tuple[int, bytes]:
    with engine.connect() as conn:
        row = conn.execute(select(ledger_head.c.last_seq, ledger_head.c.last_hash)).one()
        return row.last_seq, bytes(row.last_hash)


def rewind_last_event(engine) -> int:
    """What someone with the owner's rights can do: switch off the append-only
    triggers, delete the newest event and its postings, point the head at the one
    before. Returns the seq removed."""
    with engine.begin() as conn:
        seq, _ = conn.execute(select(ledger_head.c.last_seq, ledger_head.c.last_hash)).one()
        before = conn.execute(select(ledger_events.c.hash).where(ledger_events.c.seq == seq - 1)).scalar_one()
        if is_postgres(conn):
            for table in ("ledger_events", "ledger_postings"):
                conn.execute(text(f"ALTER TABLE {table} DISABLE TRIGGER USER"))
        else:
            for table in ("ledger_events", "ledger_postings"):
                conn.execute(text(f"DROP TRIGGER IF EXISTS {table}_no_delete"))
        conn.execute(text("DELETE FROM ledger_postings WHERE event_seq = :seq"), {"seq": seq})
        conn.execute(text("DELETE FROM ledger_events WHERE seq = :seq"), {"seq": seq})
        conn.execute(ledger_head.update().values(last_seq=seq - 1, last_hash=before))
        if is_postgres(conn):
            for table in ("ledger_events", "ledger_postings"):
                conn.execute(text(f"ALTER TABLE {table} ENABLE TRIGGER USER"))
    return seq


def test_a_rewound_chain_fails_verify_against_an_anchor_written_before(paralon, database_url, anchor_file):
    """The anchor line is what an operator's off-host copy of the file holds."""
    customer = _customer_with_grants(paralon, 3)
    engine = make_engine(database_url)
    seq, head_hash = _head(engine)
    anchor_file.write_text(json.dumps({"seq": seq, "hash": head_hash.hex(),
                                       "anchored_at": datetime.now(UTC).isoformat()}) + "\n")
    assert _json(paralon("ledger", "verify", "--json"))["ok"]

    removed = rewind_last_event(engine)
    paralon("ledger", "replay", "--json")
    assert _json(paralon("balance", str(customer), "--json"))["balance_nano_usd"] == 3 * USD, "the last grant is gone"

    failed = paralon("ledger", "verify", "--json", expect=1)
    report = _json(failed)
    assert not report["ok"] and report["anchors_checked"] == 1
    assert any(f"anchored seq {removed}" in p and "missing" in p for p in report["problems"]), report["problems"]
    assert any("rewound" in p for p in report["problems"]), report["problems"]
    engine.dispose()


def test_the_anchor_command_writes_the_head_and_verify_checks_it(paralon, database_url, anchor_file):
    customer = _customer_with_grants(paralon, 2)
    engine = make_engine(database_url)
    written = _json(paralon("ledger", "anchor", "--json"))
    seq, head_hash = _head(engine)
    assert (written["seq"], written["hash"]) == (seq, head_hash.hex())
    line = json.loads(anchor_file.read_text().splitlines()[-1])
    assert (line["seq"], line["hash"]) == (seq, head_hash.hex())
    assert datetime.fromisoformat(line["anchored_at"]).tzinfo is not None

    paralon("credits", "grant", str(customer), "--usd", "5", "--reason", "later", "--json")
    report = _json(paralon("ledger", "verify", "--json"))
    assert report["ok"] and report["anchors_checked"] == 1, "a head past the anchor is no problem"
    since = _json(paralon("ledger", "verify", "--since-anchor", "--json"))
    assert since["ok"] and since["since_seq"] == seq and since["events_checked"] == 1

    removed = rewind_last_event(engine)  # the grant after the anchor: nothing outside remembers it
    paralon("ledger", "replay", "--json")
    assert _json(paralon("ledger", "verify", "--json"))["ok"], "events after the newest anchor are not protected"
    paralon("ledger", "anchor", "--json")
    paralon("credits", "grant", str(customer), "--usd", "7", "--reason", "replaces the one removed", "--json")
    assert _head(engine)[0] == removed
    before = money_snapshot(engine)
    report = _json(paralon("ledger", "verify", "--json"))
    assert report["ok"] and report["anchors_checked"] == 2
    rewind_last_event(engine)
    rewind_last_event(engine)  # below the second anchor, then rewritten with a new event at its seq
    paralon("ledger", "replay", "--json")  # balances made to agree with the shortened log, or the guard refuses the append
    paralon("credits", "grant", str(customer), "--usd", "9", "--reason", "forged", "--json")
    report = _json(paralon("ledger", "verify", "--json", expect=1))
    assert any(f"anchored seq {seq}" in p and "hash" in p for p in report["problems"]), report["problems"]
    since = _json(paralon("ledger", "verify", "--since-anchor", "--json", expect=1))
    assert since["problems_total"] >= 1
    assert money_snapshot(engine) != before
    engine.dispose()


def test_verify_reads_a_malformed_anchor_file_as_a_problem_and_anchor_refuses_an_empty_ledger(paralon, anchor_file):
    assert "nothing to anchor" in paralon("ledger", "anchor", expect=2).stderr
    assert not anchor_file.exists()
    anchor_file.write_text('{"seq": 1, "hash": "zz"}\n')
    report = _json(paralon("ledger", "verify", "--json", expect=1))
    assert any("line 1" in p for p in report["problems"]), report["problems"]


# --- On the EVM chain (anvil) -----------------------------------------------------
ANVIL_KEY = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80"  # anvil's first funded account
ANVIL_ADDRESS = "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266"


@pytest.fixture
def chain_env():
    with running_anvil() as w3:
        yield w3, {"PARALON_CHAIN_RPC_URL": w3.provider.endpoint_uri, "PARALON_ANCHOR_WALLET_KEY": ANVIL_KEY}


def test_an_anchor_on_the_chain_survives_the_loss_of_the_file(paralon, database_url, anchor_file, chain_env):
    w3, env = chain_env
    customer = _customer_with_grants(paralon, 3)
    engine = make_engine(database_url)
    written = _json(paralon("ledger", "anchor", "--json", **env))
    seq, head_hash = _head(engine)
    assert (written["seq"], written["chain_id"], written["chain_error"]) == (seq, 31337, None)
    tx = w3.eth.get_transaction(written["tx_hash"])
    assert tx["from"] == tx["to"] == ANVIL_ADDRESS and tx["value"] == 0
    assert bytes(tx["input"]) == b"paralon-anchor" + seq.to_bytes(8, "big") + head_hash
    assert json.loads(anchor_file.read_text())["tx_hash"] == written["tx_hash"]
    report = _json(paralon("ledger", "verify", "--json", **env))
    assert report["ok"] and report["anchors_checked"] == 2, "the file's line and its transaction"

    # Anyone may send the wallet a transaction with anchor data; only the wallet's own count.
    forged = b"paralon-anchor" + (seq + 5).to_bytes(8, "big") + bytes(32)
    w3.eth.wait_for_transaction_receipt(w3.eth.send_transaction({"from": w3.eth.accounts[1], "to": ANVIL_ADDRESS, "data": forged}))
    scanned = _json(paralon("ledger", "verify", "--chain-from-block", "0", "--json", **env))
    assert scanned["ok"] and scanned["anchors_checked"] == 2, scanned

    rewind_last_event(engine)
    paralon("ledger", "replay", "--json")
    report = _json(paralon("ledger", "verify", "--json", expect=1, **env))
    assert any(f"chain 31337 tx {written['tx_hash']}" in p and "missing" in p for p in report["problems"]), report["problems"]
    assert any(f"file {anchor_file}" in p and "missing" in p for p in report["problems"]), report["problems"]

    anchor_file.unlink()  # whoever rewound the database removed the file on its host too
    report = _json(paralon("ledger", "verify", "--json", expect=1, **env))
    assert report["problems"] == ["chain 31337: the anchor wallet sent 1 transactions, the file names 0: lines are missing; "
                                  "find them with --chain-from-block"], "the wallet's count remembers the file's lines"
    report = _json(paralon("ledger", "verify", "--chain-from-block", "0", "--json", expect=1, **env))
    assert report["anchors_checked"] == 1 and any("rewound" in p for p in report["problems"]), report
    assert _json(paralon("balance", str(customer), "--json"))["balance_nano_usd"] == 3 * USD
    engine.dispose()


def test_a_file_line_edited_to_match_the_rewound_log_disagrees_with_its_transaction(paralon, database_url, anchor_file, chain_env):
    _, env = chain_env
    _customer_with_grants(paralon, 2)
    engine = make_engine(database_url)
    written = _json(paralon("ledger", "anchor", "--json", **env))
    rewind_last_event(engine)
    paralon("ledger", "replay", "--json")
    seq, head_hash = _head(engine)
    line = json.loads(anchor_file.read_text())
    anchor_file.write_text(json.dumps({**line, "seq": seq, "hash": head_hash.hex()}) + "\n")
    report = _json(paralon("ledger", "verify", "--json", expect=1, **env))
    assert any("the file says" in p and written["tx_hash"] in p for p in report["problems"]), report["problems"]
    engine.dispose()


def test_a_chain_that_cannot_be_reached_still_gets_the_file_anchor_and_verify_says_so(paralon, database_url, anchor_file):
    _customer_with_grants(paralon, 1)
    down = {"PARALON_CHAIN_RPC_URL": f"http://127.0.0.1:{free_port()}", "PARALON_ANCHOR_WALLET_KEY": ANVIL_KEY}
    written = _json(paralon("ledger", "anchor", "--json", expect=1, **down))
    assert written["tx_hash"] is None and written["chain_error"]
    assert json.loads(anchor_file.read_text())["seq"] == written["seq"]
    report = _json(paralon("ledger", "verify", "--json", **down))
    assert report["ok"] and report["anchors_checked"] == 1 and "not read" in report["anchor_notes"][0]


@pytest.mark.parametrize("variables, words", [
    ({"PARALON_ANCHOR_WALLET_KEY": "0x1234"}, "not a hex private key"),
    ({"PARALON_ANCHOR_WALLET_KEY": ANVIL_KEY, "PARALON_CHAIN_RPC_URL": ""}, "needs PARALON_CHAIN_RPC_URL"),
    ({"PARALON_ANCHOR_INTERVAL_S": "0"}, "PARALON_ANCHOR_INTERVAL_S"),
])
def test_bad_anchor_settings_are_refused_in_one_line_without_the_key(paralon, anchor_file, variables, words):
    _customer_with_grants(paralon, 1)
    for command in (["ledger", "anchor"], ["ledger", "verify"]):
        failed = paralon(*command, expect=2, **{"PARALON_CHAIN_RPC_URL": "http://127.0.0.1:1", **variables})
        assert words in failed.stderr and ANVIL_KEY[2:] not in failed.stderr, failed.stderr
    assert not anchor_file.exists()


# --- The beat ------------------------------------------------------------------------

def test_beat_anchors_the_head_every_ten_minutes_when_it_moved(engine, database_url, anchor_file, monkeypatch):
    monkeypatch.setenv("PARALON_DATABASE_URL", database_url)
    monkeypatch.setenv("PARALON_ANCHOR_FILE", str(anchor_file))
    entry = celery.conf.beat_schedule["anchor-ledger"]
    assert (entry["task"], entry["schedule"]) == ("paralon.anchor_ledger", 600.0)
    task = celery.tasks[entry["task"]]
    assert "nothing to anchor" in task.apply(throw=True).get()["skipped"]
    with engine.begin() as conn:
        customer = acc.create_account(conn, cmd.CUSTOMER, "Ada")
    append_now(engine, cmd.GrantCredits(customer, 2 * USD, "welcome", "grant:beat:1"))
    first = task.apply(throw=True).get()
    assert (first["seq"], first["hash"]) == (1, _head(engine)[1].hex())
    assert "anchored already" in task.apply(throw=True).get()["skipped"], "an idle ledger adds no line"
    append_now(engine, cmd.GrantCredits(customer, 3 * USD, "more", "grant:beat:2"))
    assert task.apply(throw=True).get()["seq"] == 2
    assert [json.loads(line)["seq"] for line in anchor_file.read_text().splitlines()] == [1, 2]
