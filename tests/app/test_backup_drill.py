"""The backup and restore drill of README ("Backup and restore drill"), on
PostgreSQL with a real `paralon serve` taking traffic: anchor, `pg_dump` while
requests go on, restore into a new database, `ledger verify --since-anchor` and
the full `verify` there, then serve from the restore. Nothing that committed
before the dump is lost, the anchors still match, and the restore charges
new requests exactly."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import openai
import pytest
from sqlalchemy import select

from ledger.anchors import read_head
from ledger.db import make_engine, snapshot_connection
from ledger.schema import account_balances, ledger_events
from tests.conftest import drop_postgres_database, new_postgres_database
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for

REQUESTS_BEFORE_ANCHOR = 20
REQUESTS_DURING_DUMP_MIN = 5
REQUESTS_ON_RESTORE = 10
INPUT_NANO_USD_PER_TOKEN, OUTPUT_NANO_USD_PER_TOKEN = 150, 600  # the fleet's $0.15 and $0.60 per MTok
TRAFFIC_STOP_TIMEOUT_S = 60


def paralon(database_url: str, anchor_file, *args: str) -> dict:
    """The command line as an operator runs it; its JSON answer."""
    env = {**os.environ, "PARALON_DATABASE_URL": database_url, "PARALON_ANCHOR_FILE": str(anchor_file)}
    done = subprocess.run([sys.executable, "-c", "from app.cli import main; main()", *args, "--json"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return json.loads(done.stdout)


def ask(client: openai.OpenAI, text: str):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=12)


class Traffic:
    """Requests one after another in a thread until stopped."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client, self.stop_event, self.answers = client, threading.Event(), []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            self.answers.append(ask(self.client, f"during the dump {len(self.answers)}"))

    def __enter__(self) -> "Traffic":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join(TRAFFIC_STOP_TIMEOUT_S)
        assert not self.thread.is_alive()


@pytest.fixture
def restored_url():
    url = new_postgres_database()
    yield url
    drop_postgres_database(url)


def _hashes(engine) -> dict[int, bytes]:
    with engine.connect() as conn:
        return {seq: bytes(h) for seq, h in conn.execute(select(ledger_events.c.seq, ledger_events.c.hash))}


def _charges_after(engine, seq: int) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == "RequestSettled",
                                                                  ledger_events.c.seq > seq)).scalars()
        return {p["request_id"]: p["charge_nano_usd"] for p in map(json.loads, rows)}


def _charge_of(answer) -> int:
    return answer.usage.prompt_tokens * INPUT_NANO_USD_PER_TOKEN + answer.usage.completion_tokens * OUTPUT_NANO_USD_PER_TOKEN


def test_a_dump_taken_under_traffic_restores_verifies_against_the_anchors_and_serves(postgres_url, restored_url, tmp_path):
    for tool in ("pg_dump", "pg_restore"):
        assert shutil.which(tool), f"{tool} (PostgreSQL's client tools) is needed for the drill"
    anchor_file, dump = tmp_path / "anchors.jsonl", tmp_path / "paralon.dump"
    worker = sim_worker("instant")
    fleet = make_fleet(postgres_url, [worker.url])
    source, restored = fleet.engine, make_engine(restored_url)
    try:
        with serving(postgres_url, PARALON_ANCHOR_FILE=str(anchor_file)) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0, timeout=60)
            for i in range(REQUESTS_BEFORE_ANCHOR):
                ask(client, f"before the anchor {i}")
            anchored = paralon(postgres_url, anchor_file, "ledger", "anchor")
            with Traffic(client) as traffic:
                wait_for(lambda: len(traffic.answers) >= REQUESTS_DURING_DUMP_MIN, timeout_s=60)
                with source.connect() as conn:
                    committed_before_dump = read_head(conn)
                subprocess.run(["pg_dump", "--format=custom", f"--file={dump}", postgres_url], check=True, timeout=120)
            assert len(traffic.answers) > REQUESTS_DURING_DUMP_MIN
        assert paralon(postgres_url, anchor_file, "ledger", "verify")["ok"]

        subprocess.run(["pg_restore", "--no-owner", "--exit-on-error", f"--dbname={restored_url}", str(dump)],
                       check=True, timeout=120)
        with restored.connect() as conn:
            restored_head = read_head(conn)
        since = paralon(restored_url, anchor_file, "ledger", "verify", "--since-anchor")
        assert since["ok"] and since["since_seq"] == anchored["seq"] and since["anchors_checked"] == 1, since
        assert since["events_checked"] == restored_head[0] - anchored["seq"] > 0
        full = paralon(restored_url, anchor_file, "ledger", "verify")
        assert full["ok"] and full["events_checked"] == restored_head[0] and full["anchors_checked"] == 1, full

        # Nothing lost: every event committed before the dump began is in the restore, as it was.
        source_hashes, restored_hashes = _hashes(source), _hashes(restored)
        assert restored_head[0] >= committed_before_dump[0]
        assert restored_hashes == {seq: h for seq, h in source_hashes.items() if seq <= restored_head[0]}
        assert set(_charges_after(restored, 0)) <= set(_charges_after(source, 0))

        with snapshot_connection(restored) as conn:
            balance_at_restore = conn.execute(select(account_balances.c.balance_nano_usd)
                                              .where(account_balances.c.account_id == fleet.customer_id)).scalar_one()
        with serving(restored_url, PARALON_ANCHOR_FILE=str(anchor_file)) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0, timeout=60)
            answers = [ask(client, f"after the restore {i}") for i in range(REQUESTS_ON_RESTORE)]
            wait_for(lambda: {a.id for a in answers} <= set(_charges_after(restored, restored_head[0])), timeout_s=60)
            with snapshot_connection(restored) as conn:
                charges = _charges_after(restored, restored_head[0])
                balance_now = conn.execute(select(account_balances.c.balance_nano_usd)
                                           .where(account_balances.c.account_id == fleet.customer_id)).scalar_one()
        assert {a.id: charges[a.id] for a in answers} == {a.id: _charge_of(a) for a in answers}
        assert all(_charge_of(a) > 0 for a in answers)
        assert balance_now == balance_at_restore - sum(charges.values())
        paralon(restored_url, anchor_file, "ledger", "anchor")
        after = paralon(restored_url, anchor_file, "ledger", "verify")
        assert after["ok"] and after["anchors_checked"] == 2, after
    finally:
        worker.stop()
        source.dispose()
        restored.dispose()
