"""Retry signals, read by the official `openai` SDK with its default retries
(max_retries=2): what no retry can fix says `x-should-retry: false` and is
asked once (the key's spend limit, no credits, a bad body, a bad key, an
unknown model), what a retry can fix says `retry-after` and is asked again.
Requests are counted by a relay in front of `paralon serve`, so what is
counted is what reached the server; no money moves in any of them. A full
queue of holds is a 503 with `retry-after` too."""
from __future__ import annotations

import threading
from collections import Counter

import httpx
import openai
import pytest
from litestar.testing import TestClient

from app.http.factory import create_app
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.db import make_engine
from ledger.group_commit import GroupCommitWriter
from ledger.service import Ledger
from proxy import keys, prices
from proxy import workers as registry
from proxy.limits import HOLDS_BUSY_RETRY_AFTER_S, NO_WORKER_RETRY_AFTER_S
from tests.ledger.helpers import money_snapshot
from tests.support import harness
from tests.support.harness import MODEL, ThreadedServer, make_fleet, serving, sim_worker

CHAT = ("POST", "/v1/chat/completions")
MESSAGES = [{"role": "user", "content": "Say something."}]
DEAD_MODEL = "no-live-worker"
UNREACHABLE_WORKER_URL = "http://127.0.0.1:1"
HOP_HEADERS = {"content-length", "transfer-encoding", "content-encoding", "connection"}

READ_TIMEOUT_S = 10
# `paralon serve` took 35 s to listen on a machine loaded twentyfold: more than the harness waits.
SERVE_START_TIMEOUT_S = 120


class CountingRelay:
    """Passes each request to `target` and counts it by method and path."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.requests: Counter = Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.requests[(scope["method"], scope["path"])] += 1
        query = b"?" + scope["query_string"] if scope["query_string"] else b""
        headers = [(k, v) for k, v in scope["headers"] if k != b"host"]
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.request(scope["method"], self.target + (scope["raw_path"] + query).decode(),
                                          headers=headers, content=body)
        kept = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS]
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": kept + [(b"content-length", str(len(answer.content)).encode())]})
        await send({"type": "http.response.body", "body": answer.content})


@pytest.fixture
def counted(database_url, monkeypatch):
    """A customer whose key has a spend limit below any request, one with no
    credits, a key without a limit, and a model whose only worker never answers."""
    monkeypatch.setattr(harness, "START_TIMEOUT_S", SERVE_START_TIMEOUT_S)
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url], spend_limit_usd="0.000001")
    with fleet.engine.begin() as conn:
        broke = acc.create_account(conn, cmd.CUSTOMER, "no credits")
        _, broke_key = keys.create_key(conn, broke)
        _, open_key = keys.create_key(conn, fleet.customer_id)
        prices.set_price(conn, DEAD_MODEL, "0.15", "0.60")
        registry.add_worker(conn, fleet.owner_ids[0], UNREACHABLE_WORKER_URL, DEAD_MODEL)
    with serving(database_url) as proxy:
        relay = CountingRelay(proxy.url)
        front = ThreadedServer(relay).start()
        yield fleet, relay, front.url + "/v1", {"limited": fleet.key, "broke": broke_key, "open": open_key}
        front.stop()
    worker.stop()
    fleet.engine.dispose()


def _refused_once(relay: CountingRelay, error: openai.APIStatusError, route: tuple[str, str]) -> None:
    assert relay.requests[route] == 1, f"asked {relay.requests[route]} times"
    assert error.response.headers["x-should-retry"] == "false"
    relay.requests.clear()


def test_what_no_retry_fixes_is_asked_once_and_what_one_may_fix_is_asked_again(counted):
    fleet, relay, base_url, key = counted
    before = money_snapshot(fleet.engine)

    limited = openai.OpenAI(base_url=base_url, api_key=key["limited"])  # max_retries: the SDK's default, 2
    with pytest.raises(openai.RateLimitError) as spent:
        limited.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    assert (spent.value.code, spent.value.type) == ("insufficient_quota", "insufficient_quota"), "as OpenAI's quota error"
    assert "spend limit" in spent.value.message
    _refused_once(relay, spent.value, CHAT)

    broke = openai.OpenAI(base_url=base_url, api_key=key["broke"])
    with pytest.raises(openai.APIStatusError) as no_credits:
        broke.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    assert type(no_credits.value) is openai.APIStatusError and no_credits.value.status_code == 402
    assert (no_credits.value.code, no_credits.value.type) == ("insufficient_credits", "insufficient_quota")
    assert "not enough credits" in no_credits.value.message and "add credits" in no_credits.value.message
    _refused_once(relay, no_credits.value, CHAT)

    client = openai.OpenAI(base_url=base_url, api_key=key["open"])
    with pytest.raises(openai.BadRequestError) as bad_body:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=9)
    assert bad_body.value.param == "temperature"
    _refused_once(relay, bad_body.value, CHAT)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=8)
    assert unknown.value.code == "model_not_found"
    _refused_once(relay, unknown.value, CHAT)
    with pytest.raises(openai.AuthenticationError) as bad_key:
        openai.OpenAI(base_url=base_url, api_key="sk-par-wrong").chat.completions.create(model=MODEL, messages=MESSAGES)
    _refused_once(relay, bad_key.value, CHAT)

    retried = openai.OpenAI(base_url=base_url, api_key=key["open"], max_retries=1)
    with pytest.raises(openai.InternalServerError) as no_worker:
        retried.chat.completions.create(model=DEAD_MODEL, messages=MESSAGES, max_tokens=8)
    assert no_worker.value.status_code == 503 and no_worker.value.code == "no_worker_available"
    assert no_worker.value.response.headers["retry-after"] == str(NO_WORKER_RETRY_AFTER_S)
    assert "x-should-retry" not in no_worker.value.response.headers
    assert relay.requests[CHAT] == 2, "asked again after retry-after"

    assert money_snapshot(fleet.engine) == before, "nothing held, nothing charged"
    assert fleet.balance(fleet.customer_id).held_nano_usd == 0 and fleet.settlements() == []


def test_litestars_own_4xx_say_no_retry_too(site):
    before = site.money()
    no_route = site.call("GET", "/v1/no-such-route", site.key)
    assert no_route.status_code == 404 and no_route.headers["x-should-retry"] == "false"
    bad_method = site.call("PATCH", "/v1/chat/completions", site.key)
    assert bad_method.status_code == 405 and bad_method.headers["x-should-retry"] == "false" and "allow" in bad_method.headers
    assert site.money() == before


def test_a_full_holds_queue_is_a_503_that_says_when_to_ask_again_and_holds_nothing(tmp_path):
    """The holds' writer stopped inside one batch with its queue full (one
    slot): the next request's hold is refused at once, and it is told to ask
    again, not an internal error. The stopped writer works on a database of
    its own, so that its open batch locks nothing of the fleet's."""
    worker = sim_worker()
    fleet = make_fleet(f"sqlite:///{tmp_path}/paralon.db", [worker.url])
    ledger, aside = Ledger(fleet.engine), make_engine(f"sqlite:///{tmp_path}/aside.db")
    entered, opened = threading.Event(), threading.Event()

    def stopped_inside_a_batch(conn, commands):
        entered.set()
        opened.wait()
        return list(commands)

    full = GroupCommitWriter(aside, stopped_inside_a_batch, name="full-holds", batch_size_max=1, queue_depth_max=1, batch_wait_ms=0)
    usual, ledger.holder = ledger.holder, full
    waiting = [full.submit("in the batch")]
    try:
        assert entered.wait(READ_TIMEOUT_S)
        waiting.append(full.submit("in the queue"))
        before = money_snapshot(fleet.engine)
        with TestClient(create_app(ledger, health_interval_s=60)) as client:
            refused = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {fleet.key}"},
                                  json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == str(HOLDS_BUSY_RETRY_AFTER_S)
        assert refused.json()["error"]["code"] == "overloaded"
        assert money_snapshot(fleet.engine) == before and worker.app.engine.state.requests_started == 0, \
            "nothing held, nothing charged, no worker asked"
    finally:
        opened.set()
        for queued in waiting:
            queued.result(READ_TIMEOUT_S)
        ledger.holder = usual
        for closing in (full.close, ledger.close, aside.dispose, fleet.engine.dispose, worker.stop):
            closing()
