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
from ledger.db import is_postgres, make_engine
from ledger.schema import ledger_events, ledger_head
from tests.ledger.helpers import money_snapshot

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
    paralon("credits", "grant", str(customer), "--usd", "9", "--reason", "forged", "--json")
    paralon("ledger", "replay", "--json")
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
