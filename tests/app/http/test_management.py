"""Management tokens and the management API: each role sees and changes only
what it may, another account's data answers 404, and API keys and management
tokens are not interchangeable."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner
from sqlalchemy import select

from app.cli import main
from app.tokens import create_token, management_tokens
from proxy.keys import key_sha256
from ledger import accounts as acc
from ledger.db import make_engine
from ledger.schema import accounts
from proxy import workers as registry
from tests.support.harness import MODEL, make_fleet, serving, sim_worker


@pytest.fixture
def served(database_url):
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url])
    with fleet.engine.begin() as conn:
        other_customer = acc.create_account(conn, "customer", "someone else")
        other_owner = acc.create_account(conn, "owner", "another GPU farm")
        other_worker = registry.add_worker(conn, other_owner, "http://127.0.0.1:1", MODEL)
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == "platform:revenue")).scalar_one()
        tokens = {
            "customer": create_token(conn, fleet.customer_id, "customer")[1],
            "accountant": create_token(conn, fleet.customer_id, "accountant")[1],
            "owner": create_token(conn, fleet.owner_ids[0], "owner")[1],
            "admin": create_token(conn, platform, "admin")[1],
            "other_customer": create_token(conn, other_customer, "customer")[1],
        }
    with serving(database_url) as proxy:
        yield fleet, proxy, tokens, other_worker
    worker.stop()
    fleet.engine.dispose()


def _call(proxy, method: str, path: str, token: str | None, **kwargs) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, proxy.url + path, headers=headers, **kwargs)


def test_each_role_sees_its_own_account(served):
    fleet, proxy, tokens, _ = served
    customer = _call(proxy, "GET", "/v1/account", tokens["customer"]).json()
    assert customer["id"] == fleet.customer_id and customer["available_nano_usd"] == 10_000_000_000
    assert _call(proxy, "GET", "/v1/account", tokens["accountant"]).json()["role"] == "accountant"
    assert "earnings_nano_usd" in _call(proxy, "GET", "/v1/account", tokens["owner"]).json()


def test_a_customer_manages_its_keys_and_nobody_elses(served):
    fleet, proxy, tokens, _ = served
    created = _call(proxy, "POST", "/v1/keys", tokens["customer"], json={"name": "ci", "spend_limit_usd": "5"})
    assert created.status_code == 201 and created.json()["key"].startswith("sk-par-")
    key_id = created.json()["id"]
    listed = _call(proxy, "GET", "/v1/keys", tokens["customer"]).json()["data"]
    assert {k["id"] for k in listed} == {fleet.key_id, key_id} and all("key" not in k for k in listed)

    assert _call(proxy, "DELETE", f"/v1/keys/{key_id}", tokens["other_customer"]).status_code == 404
    assert _call(proxy, "GET", "/v1/keys", tokens["other_customer"]).json()["data"] == []
    assert _call(proxy, "POST", "/v1/keys", tokens["accountant"], json={}).status_code == 403, "accountants only read"
    assert _call(proxy, "DELETE", f"/v1/keys/{key_id}", tokens["customer"]).json()["revoked"] is True
    assert _call(proxy, "DELETE", "/v1/keys/999999", tokens["customer"]).status_code == 404

    for bad in ({"spend_limit_usd": "1.2345678901"}, {"spend_limit_usd": "-3"}, [1, 2]):
        before = len(_call(proxy, "GET", "/v1/keys", tokens["customer"]).json()["data"])
        response = _call(proxy, "POST", "/v1/keys", tokens["customer"], json=bad)
        assert response.status_code == 400 and response.json()["error"]["message"]
        assert len(_call(proxy, "GET", "/v1/keys", tokens["customer"]).json()["data"]) == before
    not_json = _call(proxy, "POST", "/v1/keys", tokens["customer"], content=b"{nope")
    assert not_json.status_code == 400


def test_an_owner_drains_its_own_workers_only(served):
    fleet, proxy, tokens, other_worker = served
    mine = _call(proxy, "GET", "/v1/workers", tokens["owner"]).json()["data"]
    assert [w["id"] for w in mine] == fleet.worker_ids
    assert _call(proxy, "POST", f"/v1/workers/{other_worker}/drain", tokens["owner"]).status_code == 404
    assert fleet.worker(other_worker).state == "active"
    assert _call(proxy, "POST", f"/v1/workers/{fleet.worker_ids[0]}/drain", tokens["owner"]).json()["state"] == "draining"
    everyone = _call(proxy, "GET", "/v1/workers", tokens["admin"]).json()["data"]
    assert {w["id"] for w in everyone} == {*fleet.worker_ids, other_worker}
    assert _call(proxy, "GET", "/v1/workers", tokens["customer"]).status_code == 403


def test_keys_and_tokens_are_not_interchangeable(served):
    fleet, proxy, tokens, _ = served
    assert _call(proxy, "GET", "/v1/account", fleet.key).status_code == 401, "an API key is no management token"
    assert _call(proxy, "GET", "/v1/account", None).status_code == 401
    inference = _call(proxy, "POST", "/v1/chat/completions", tokens["customer"],
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert inference.status_code == 401, "a management token is no API key"
    assert fleet.settlements() == [] and fleet.balance(fleet.customer_id).held_nano_usd == 0


def test_tokens_from_the_cli_are_shown_once_and_revocable(database_url):
    runner = CliRunner()

    def run(*args, expect=0):
        result = runner.invoke(main, list(args), env={"PARALON_DATABASE_URL": database_url}, catch_exceptions=False)
        assert result.exit_code == expect, result.output
        return result

    run("migrate")
    customer = json.loads(run("accounts", "create", "--kind", "customer", "--name", "Ada", "--json").stdout)["id"]
    created = json.loads(run("tokens", "create", str(customer), "--role", "accountant", "--json").stdout)
    assert created["token"].startswith("pt-par-")
    engine = make_engine(database_url)
    with engine.connect() as conn:
        stored = conn.execute(select(management_tokens)).one()
    engine.dispose()
    assert stored.token_sha256 == key_sha256(created["token"]) and created["token"] not in str(tuple(stored))
    refused = json.loads(run("tokens", "create", str(customer), "--role", "admin", "--json", expect=2).stderr)["error"]
    assert refused["code"] == "wrong_account_kind"
    platform = json.loads(run("accounts", "platform", "--json").stdout)["id"]
    assert json.loads(run("tokens", "create", str(platform), "--role", "admin", "--json").stdout)["token"]
    run("tokens", "revoke", str(created["id"]), "--json")
    run("tokens", "revoke", "999999", "--json", expect=2)


def test_invoices_usage_and_earnings_are_scoped_to_the_token(served):
    from invoices import read_models
    from invoices.service import InvoiceSettings, issue_for_top_up
    from ledger import commands as cmd
    from ledger.service import append_now

    fleet, proxy, tokens, _ = served
    openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    read_models.catch_up(fleet.engine)
    top_up = append_now(fleet.engine, cmd.PurchaseCredits(fleet.customer_id, 5 * 10**9, "card", "stripe:x", "external:stripe", "x")).seq
    invoice = issue_for_top_up(fleet.engine, InvoiceSettings(Path(tempfile.mkdtemp())), top_up)

    listed = _call(proxy, "GET", "/v1/invoices", tokens["accountant"]).json()["data"]
    assert [i["number"] for i in listed] == [invoice["number"]]
    assert _call(proxy, "GET", "/v1/invoices?kind=credit_note", tokens["customer"]).json()["data"] == []
    assert _call(proxy, "GET", "/v1/invoices?from=2000-01", tokens["customer"]).json()["data"] == listed
    assert _call(proxy, "GET", "/v1/invoices?from=nope", tokens["customer"]).status_code == 400
    pdf = _call(proxy, "GET", f"/v1/invoices/{invoice['number']}.pdf", tokens["accountant"])
    assert pdf.status_code == 200 and pdf.content.startswith(b"%PDF")
    assert _call(proxy, "GET", f"/v1/invoices/{invoice['number']}.pdf", tokens["other_customer"]).status_code == 404
    assert _call(proxy, "GET", "/v1/invoices", tokens["other_customer"]).json()["data"] == []

    by_model = _call(proxy, "GET", "/v1/usage?group_by=model", tokens["customer"]).json()["data"]
    assert by_model[0]["model"] == MODEL and by_model[0]["requests"] == 1 and by_model[0]["completion_tokens"] == 4
    assert _call(proxy, "GET", "/v1/usage?group_by=worker", tokens["customer"]).status_code == 400
    assert _call(proxy, "GET", "/v1/usage", tokens["other_customer"]).json()["data"] == []
    earned = _call(proxy, "GET", "/v1/earnings?group_by=worker", tokens["owner"]).json()["data"]
    assert earned[0]["worker"] == fleet.worker_ids[0]
    assert earned[0]["earnings_nano_usd"] == fleet.balance(fleet.owner_ids[0]).balance_nano_usd
    assert _call(proxy, "GET", "/v1/earnings", tokens["customer"]).status_code == 403


def test_only_an_admin_resumes_a_suspended_worker_and_the_owner_sees_why(served):
    from ledger.schema import ledger_events
    from tests.ledger.helpers import money_snapshot
    from tests.proxy.test_workers_strikes import suspend_by_proof

    fleet, proxy, tokens, other_worker = served
    worker_id = fleet.worker_ids[0]
    evidence = suspend_by_proof(fleet.engine, worker_id, fleet.customer_id)
    [seen] = _call(proxy, "GET", "/v1/workers", tokens["owner"]).json()["data"]
    assert (seen["id"], seen["state"], seen["usage_strikes"]) == (worker_id, "suspended", 3)
    assert seen["suspension_reason"] == "3 usage strikes: completion_above_bound" and seen["suspended_at"]
    before = money_snapshot(fleet.engine)

    for role in ("owner", "customer", "accountant"):  # an owner may not lift its own worker's suspension
        assert _call(proxy, "POST", f"/v1/workers/{worker_id}/resume", tokens[role]).status_code == 403
    assert _call(proxy, "POST", f"/v1/workers/{worker_id}/resume", None).status_code == 401
    assert _call(proxy, "POST", "/v1/workers/999999/resume", tokens["admin"]).status_code == 404
    assert _call(proxy, "POST", f"/v1/workers/{other_worker}/resume", tokens["admin"]).status_code == 409, "it is active"
    for bad in ({"reason": ""}, {"reason": 7}, [1]):
        assert _call(proxy, "POST", f"/v1/workers/{worker_id}/resume", tokens["admin"], json=bad).status_code == 400
    assert fleet.worker(worker_id).state == "suspended" and money_snapshot(fleet.engine) == before, "nothing written"

    resumed = _call(proxy, "POST", f"/v1/workers/{worker_id}/resume", tokens["admin"], json={"reason": "engine upgraded"})
    assert resumed.status_code == 200
    assert (resumed.json()["state"], resumed.json()["usage_strikes"], resumed.json()["suspension_reason"]) == ("active", 0, None)
    assert _call(proxy, "POST", f"/v1/workers/{worker_id}/resume", tokens["admin"]).status_code == 409, "once"
    with fleet.engine.connect() as conn:
        events = {r.event_type: json.loads(r.payload) for r in conn.execute(
            select(ledger_events.c.event_type, ledger_events.c.payload).where(ledger_events.c.event_type.like("Worker%")))}
    assert events["WorkerSuspended"]["request_ids"] == evidence
    with fleet.engine.connect() as conn:
        admin_token_id = conn.execute(select(management_tokens.c.id)
                                      .where(management_tokens.c.token_sha256 == key_sha256(tokens["admin"]))).scalar_one()
    assert events["WorkerResumed"] == {"worker_id": worker_id, "resumed_by": f"admin token {admin_token_id}",
                                       "reason": "engine upgraded", "strikes_cleared": 3}

    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
    answer = wait_for_answer(client)  # routed to again once the replica reads its state
    [settled] = fleet.settlements()
    assert settled["request_id"] == answer.id and settled["owner_account_id"] == fleet.owner_ids[0]
    assert fleet.balance(fleet.customer_id).balance_nano_usd == 10_000_000_000 - settled["charge_nano_usd"]
    fleet.assert_books_close()


def wait_for_answer(client, timeout_s: float = 15.0):
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
