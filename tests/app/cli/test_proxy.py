"""`paralon keys`, `models` and `workers`, on SQLite and on PostgreSQL: each
bad input is one clear error, exit status 2, and nothing written."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from app.cli import main
from ledger.db import make_engine
from ledger.schema import ledger_events
from proxy.keys import key_sha256
from proxy.schema import api_keys, model_prices, workers
from tests.ledger.helpers import money_snapshot
from tests.proxy.test_workers_strikes import suspend_by_proof


@pytest.fixture
def paralon(database_url):
    runner = CliRunner()

    def run(*args, expect: int = 0):
        result = runner.invoke(main, list(args), env={"PARALON_DATABASE_URL": database_url}, catch_exceptions=False)
        assert result.exit_code == expect, (result.output, result.stderr)
        return json.loads(result.stdout) if expect == 0 and "--json" in args else result

    run("migrate", "--json")
    return run


@pytest.fixture
def rows(database_url):
    engine = make_engine(database_url)

    def count() -> dict:
        with engine.connect() as conn:
            return {t.name: conn.execute(select(func.count()).select_from(t)).scalar() for t in (api_keys, model_prices, workers)}

    yield count
    engine.dispose()


def _accounts(paralon) -> tuple[int, int]:
    customer = paralon("accounts", "create", "--kind", "customer", "--name", "Ada", "--json")["id"]
    owner = paralon("accounts", "create", "--kind", "owner", "--name", "GPU farm", "--json")["id"]
    return customer, owner


def test_a_key_is_shown_once_stored_hashed_and_revocable(paralon, database_url):
    customer, _ = _accounts(paralon)
    created = paralon("keys", "create", str(customer), "--spend-limit-usd", "5", "--json")
    assert created["key"].startswith("sk-par-") and created["spend_limit_nano_usd"] == 5_000_000_000
    engine = make_engine(database_url)
    with engine.connect() as conn:
        stored = conn.execute(select(api_keys)).one()
    engine.dispose()
    assert stored.key_sha256 == key_sha256(created["key"]) and created["key"] not in str(tuple(stored))
    listed = paralon("keys", "list", str(customer), "--json")["keys"]
    assert listed[0]["prefix"] == created["key"][:12] and "key" not in listed[0]
    paralon("keys", "revoke", str(created["id"]), "--json")
    assert paralon("keys", "list", str(customer), "--json")["keys"][0]["revoked"] is True


def test_prices_and_workers(paralon):
    _, owner = _accounts(paralon)
    price = paralon("models", "set-price", "m", "--input-usd-per-mtok", "0.15", "--output-usd-per-mtok", "0.60", "--json")
    assert (price["input_nano_usd_per_token"], price["output_nano_usd_per_token"]) == (150, 600)
    added = paralon("workers", "add", "--owner", str(owner), "--url", "http://10.0.0.5:8000/", "--model", "m", "--json")
    listed = paralon("workers", "list", "--json")["workers"]
    assert [(w["id"], w["url"], w["state"], w["engine"]) for w in listed] == [(added["id"], "http://10.0.0.5:8000", "active", "vllm")]
    drained = paralon("workers", "drain", str(added["id"]), "--json")
    assert drained["state"] == "draining" and drained["drain_requested_at"]


@pytest.mark.parametrize(
    "args",
    [
        ("keys", "create", "999999", "--json"),                               # unknown account
        ("keys", "create", "{owner}", "--json"),                              # keys belong to customers
        ("keys", "create", "{customer}", "--spend-limit-usd", "0", "--json"),
        ("keys", "create", "{customer}", "--spend-limit-usd", "-1", "--json"),
        ("keys", "revoke", "999999", "--json"),
        ("models", "set-price", "m", "--input-usd-per-mtok", "0.0001", "--output-usd-per-mtok", "1", "--json"),
        ("models", "set-price", "m", "--input-usd-per-mtok", "1", "--output-usd-per-mtok", "0", "--json"),
        ("models", "set-price", "m", "--input-usd-per-mtok", "-1", "--output-usd-per-mtok", "1", "--json"),
        ("models", "set-price", "m", "--input-usd-per-mtok", "abc", "--output-usd-per-mtok", "1", "--json"),
        ("workers", "add", "--owner", "{customer}", "--url", "http://h:1", "--model", "m", "--json"),
        ("workers", "add", "--owner", "{owner}", "--url", "ftp://h:1", "--model", "m", "--json"),
        ("workers", "add", "--owner", "{owner}", "--url", "http://h:99999", "--model", "m", "--json"),
        ("workers", "add", "--owner", "{owner}", "--url", "http://h:1", "--model", "m", "--engine", "llamacpp", "--json"),
        ("workers", "add", "--owner", "{owner}", "--url", "http://h:1", "--model", "m", "--context-length", "0", "--json"),
        ("workers", "drain", "999999", "--json"),
    ],
)
def test_bad_input_is_one_clear_error_and_writes_nothing(paralon, rows, args):
    customer, owner = _accounts(paralon)
    before = rows()
    result = paralon(*[a.format(customer=customer, owner=owner) for a in args], expect=2)
    error = json.loads(result.stderr)["error"]
    assert error["code"] and error["message"]
    assert rows() == before


def _suspended_worker(paralon, database_url) -> tuple[int, list[str]]:
    customer, owner = _accounts(paralon)
    worker_id = paralon("workers", "add", "--owner", str(owner), "--url", "http://10.0.0.5:8000", "--model", "m", "--json")["id"]
    engine = make_engine(database_url)
    try:
        return worker_id, suspend_by_proof(engine, worker_id, customer)
    finally:
        engine.dispose()


def _worker_events(database_url) -> list[tuple[str, dict]]:
    engine = make_engine(database_url)
    with engine.connect() as conn:
        rows = conn.execute(select(ledger_events.c.event_type, ledger_events.c.payload)
                            .where(ledger_events.c.event_type.in_(("WorkerSuspended", "WorkerResumed"))).order_by(ledger_events.c.seq))
        found = [(r.event_type, json.loads(r.payload)) for r in rows]
    engine.dispose()
    return found


def test_a_suspended_worker_shows_why_and_is_resumed_with_an_event(paralon, database_url):
    worker_id, evidence = _suspended_worker(paralon, database_url)
    [listed] = paralon("workers", "list", "--json")["workers"]
    assert (listed["state"], listed["usage_strikes"]) == ("suspended", 3)
    assert listed["suspension_reason"] == "3 usage strikes: completion_above_bound" and listed["suspended_at"]
    assert "suspended at" in paralon("workers", "list").stdout
    engine = make_engine(database_url)
    before = money_snapshot(engine)["balances"]

    resumed = paralon("workers", "resume", str(worker_id), "--reason", "the owner replaced its engine", "--json")
    assert (resumed["state"], resumed["usage_strikes"], resumed["suspended_at"], resumed["suspension_reason"]) == ("active", 0, None, None)
    assert _worker_events(database_url) == [
        ("WorkerSuspended", {"worker_id": worker_id, "reason": listed["suspension_reason"], "strikes": 3,
                             "request_ids": evidence}),
        ("WorkerResumed", {"worker_id": worker_id, "resumed_by": "operator (command line)",
                           "reason": "the owner replaced its engine", "strikes_cleared": 3}),
    ]
    assert money_snapshot(engine)["balances"] == before, "no money moves"
    engine.dispose()
    assert paralon("ledger", "verify", "--json")["ok"] is True


@pytest.mark.parametrize("args", [
    ("workers", "resume", "999999", "--json"),                          # no such worker
    ("workers", "resume", "{worker}", "--reason", "", "--json"),         # a reason is text
    ("workers", "resume", "{worker}", "--reason", "x" * 501, "--json"),
    ("workers", "resume", "{worker}", "--reason", "a\x00b", "--json"),
    ("workers", "resume", "{active}", "--json"),                        # only a suspended worker is resumed
])
def test_resume_refuses_bad_input_in_one_line_and_writes_nothing(paralon, database_url, args):
    worker_id, _ = _suspended_worker(paralon, database_url)
    owner = paralon("accounts", "create", "--kind", "owner", "--name", "another farm", "--json")["id"]
    active = paralon("workers", "add", "--owner", str(owner), "--url", "http://10.0.0.6:8000", "--model", "m", "--json")["id"]
    engine = make_engine(database_url)
    before = (money_snapshot(engine), paralon("workers", "list", "--json"))
    result = paralon(*[a.format(worker=worker_id, active=active) for a in args], expect=2)
    assert len(result.stderr.strip().splitlines()) == 1
    assert (money_snapshot(engine), paralon("workers", "list", "--json")) == before
    engine.dispose()


def test_a_drained_worker_is_not_resumed(paralon, database_url):
    worker_id, _ = _suspended_worker(paralon, database_url)
    assert paralon("workers", "drain", str(worker_id), "--json")["state"] == "draining"
    refused = json.loads(paralon("workers", "resume", str(worker_id), "--json", expect=2).stderr)["error"]
    assert refused["code"] == "worker_not_suspended"
    assert paralon("workers", "list", "--json")["workers"][0]["state"] == "draining"
    assert [event for event, _ in _worker_events(database_url)] == ["WorkerSuspended"]
