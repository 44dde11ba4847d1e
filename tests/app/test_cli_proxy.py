"""`paralon keys`, `models` and `workers`, on SQLite and on PostgreSQL: each
bad input is one clear error, exit status 2, and nothing written."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from app.cli import main
from ledger.db import make_engine
from proxy.keys import key_sha256
from proxy.schema import api_keys, model_prices, workers


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
