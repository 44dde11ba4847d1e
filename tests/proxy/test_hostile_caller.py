"""A hostile caller against real `paralon serve` replicas on PostgreSQL.

Concurrent requests against a key's spend limit and against a balance on two
replicas, streams that outlive the hold TTL, body fields an honest worker
would obey, a revoked key, callers that leave mid-stream, agent conversations.
Every test counts what the caller received on its own (the simulated worker
sends one word per token) and compares it with what was billed, then closes
the books to the nano-dollar: the customer lost exactly the sum of the
settlements, each owner got charge*80//100 of each, the platform the rest,
nothing is left held and `ledger verify` is clean."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import openai
import orjson
import pytest
from sqlalchemy import select

from app.tokens import create_token
from ledger import commands as cmd
from ledger.money import usd_to_nano_usd
from ledger.schema import accounts
from ledger.verify import verify
from proxy.sim.profiles import get_profile
from proxy.sim.requests import count_prompt_tokens
from proxy.sim.worker import SimWorker, build_app
from tests.support.harness import MODEL, ServeProcess, ThreadedServer, make_fleet

# make_fleet's default prices: $0.15 and $0.60 per million tokens.
INPUT_NANO_USD_PER_TOKEN = 150
OUTPUT_NANO_USD_PER_TOKEN = 600
OWNER_SHARE_PERCENT = 80
SETTLED_WAIT_S = 20.0
REQUEST_TIMEOUT_S = 120.0
# How long a revocation may take to reach another replica ("at once"); the
# cache TTL it must beat is 60 s.
REVOCATION_REACH_S = 0.5
# A caller that leaves may be billed for what was already on its way.
DISCONNECT_TOLERANCE_TOKENS = 2
# Fields the simulated worker obeys, and junk no engine documents.
HOSTILE_FIELDS = ("sim_inflate_usage", "sim_fail_after_tokens", "sim_extra_tokens", "sim_tokens",
                  "paralon_debug", "x_trace", "worker_override")


# --- what the caller received, counted by the caller ------------------------------


@dataclass
class Received:
    status: int
    request_id: str | None = None
    text: str = ""
    done: bool = False  # the stream ended with [DONE] (always True for a non-streaming 200)
    error: dict | None = None
    usage: dict | None = None
    cost_nano_usd: int | None = None

    @property
    def tokens(self) -> int:
        """The simulated worker sends one word per token: words are tokens, however they are chunked."""
        return len(self.text.split())


def charge_of(prompt_tokens: int, completion_tokens: int, *, input_price: int = INPUT_NANO_USD_PER_TOKEN,
              output_price: int = OUTPUT_NANO_USD_PER_TOKEN) -> int:
    return prompt_tokens * input_price + completion_tokens * output_price


def sim_prompt_tokens(messages: list[dict]) -> int:
    """What the simulated worker honestly reports for a plain chat."""
    return count_prompt_tokens([(m.get("content") or "").encode() for m in messages])


def _headers(key: str) -> dict:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


async def raw_stream(client: httpx.AsyncClient, base_url: str, key: str, body: dict) -> Received:
    """A streaming request read event by event: [DONE] and error events are visible here."""
    async with client.stream("POST", base_url + "/v1/chat/completions", json={**body, "stream": True},
                             headers=_headers(key), timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            await response.aread()
            return Received(response.status_code, error=response.json().get("error"))
        received = Received(200, request_id=response.headers.get("x-request-id"))
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                received.done = True
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                received.error = chunk["error"]
            for choice in chunk.get("choices") or ():
                received.text += (choice.get("delta") or {}).get("content") or ""
            if chunk.get("usage") and not chunk.get("choices"):
                received.usage = chunk["usage"]
                received.cost_nano_usd = chunk["usage"]["cost_details"]["nano_usd"]
        return received


async def sdk_stream(client: openai.AsyncOpenAI, *, leave_after_tokens: int | None = None, **request) -> Received:
    """A streaming request through the official SDK, with usage; optionally leaving early."""
    try:
        stream = await client.chat.completions.create(model=MODEL, stream=True,
                                                      stream_options={"include_usage": True}, **request)
    except openai.APIStatusError as exc:
        return Received(exc.status_code, error=exc.body)
    received = Received(200)
    async for chunk in stream:
        received.request_id = chunk.id
        if chunk.choices:
            received.text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            received.usage = chunk.usage.model_dump()
            received.cost_nano_usd = chunk.usage.model_extra["cost_details"]["nano_usd"]
        if leave_after_tokens is not None and received.tokens >= leave_after_tokens:
            await stream.close()  # the caller leaves: the connection is closed mid-stream
            return received
    received.done = True  # the SDK ends the iteration at [DONE]
    return received


async def sdk_complete(client: openai.AsyncOpenAI, **request) -> Received:
    """A non-streaming request through the SDK; the cost comes in a header."""
    try:
        raw = await client.chat.completions.with_raw_response.create(model=MODEL, **request)
    except openai.APIStatusError as exc:
        return Received(exc.status_code, error=exc.body)
    completion = raw.parse()
    return Received(raw.status_code, request_id=completion.id, text=completion.choices[0].message.content or "",
                    done=True, usage=completion.usage.model_dump(),
                    cost_nano_usd=int(raw.headers["x-paralon-cost-nano-usd"]))


def sdk_client(replica, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key=key, max_retries=0, timeout=REQUEST_TIMEOUT_S)


# --- the books ---------------------------------------------------------------------


def platform_revenue(fleet) -> int:
    with fleet.engine.connect() as conn:
        platform_id = conn.execute(select(accounts.c.id).where(accounts.c.system_code == cmd.PLATFORM_REVENUE_ACCOUNT)).scalar()
    return fleet.balance(platform_id).balance_nano_usd if platform_id is not None else 0


def wait_until_nothing_held(fleet, timeout_s: float = SETTLED_WAIT_S) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        held = fleet.balance(fleet.customer_id).held_nano_usd
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def assert_books_exact(fleet, credits_nano_usd: int) -> list[dict]:
    """The customer lost exactly the settlements, owners got 80% of each, the
    platform the rest, nothing is held, and the ledger verifies."""
    assert wait_until_nothing_held(fleet) == 0, "a hold is left behind"
    settled = fleet.settlements()
    charges = [s["charge_nano_usd"] for s in settled]
    assert len({s["request_id"] for s in settled}) == len(settled), "a request was settled twice"
    assert fleet.balance(fleet.customer_id).balance_nano_usd == credits_nano_usd - sum(charges)
    owner_shares = [c * OWNER_SHARE_PERCENT // 100 for c in charges]
    assert sum(fleet.balance(o).balance_nano_usd for o in fleet.owner_ids) == sum(owner_shares)
    assert platform_revenue(fleet) == sum(charges) - sum(owner_shares)
    with fleet.engine.connect() as conn:
        assert verify(conn).ok
    return settled


def assert_billed_what_was_received(received: Received, settlement: dict, prompt_tokens: int, **prices) -> None:
    """Billed tokens and cost equal the caller's own count, in the response and in the ledger."""
    expected = charge_of(prompt_tokens, received.tokens, **prices)
    assert received.tokens > 0
    assert settlement["meta"]["completion_tokens"] == received.tokens
    assert settlement["meta"]["prompt_tokens"] == prompt_tokens
    assert settlement["charge_nano_usd"] == expected
    assert received.cost_nano_usd == expected
    assert received.usage["completion_tokens"] == received.tokens
    assert received.usage["prompt_tokens"] == prompt_tokens


# --- real parts, stopped whatever happens ------------------------------------------


@pytest.fixture
def cleanup(postgres_url):
    with ExitStack() as stack:
        yield stack


def start_worker(cleanup: ExitStack, app) -> ThreadedServer:
    server = ThreadedServer(app).start()
    cleanup.callback(server.stop)
    return server


def start_replicas(cleanup: ExitStack, database_url: str, count: int, **env: str) -> list[ServeProcess]:
    """`count` replicas on one database, started side by side (each takes seconds to boot)."""
    replicas = [ServeProcess(database_url, **env) for _ in range(count)]
    for replica in replicas:
        cleanup.callback(replica.stop)
    with ThreadPoolExecutor(count) as pool:
        for started in [pool.submit(r.start) for r in replicas]:
            started.result()
    return replicas


class RecordingSimWorker(SimWorker):
    """The simulated worker, keeping every request body exactly as it arrived."""

    def __init__(self) -> None:
        super().__init__(get_profile("instant"), MODEL, seed=0, max_model_len=None, inflate_usage=1, time_scale=1.0)
        self.bodies: list[dict] = []

    def parse_request(self, body: bytes, chat: bool):
        self.bodies.append(orjson.loads(body))
        return super().parse_request(body, chat)


class TemplateCountingWorker(RecordingSimWorker):
    """An honest worker whose prompt count covers every byte a chat template
    shows the model (tool calls, tool replies, tool definitions, the response
    schema), at the simulated worker's rule: bytes // 4 + 4 per part."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt_reports: list[int] = []  # what it reported, request by request

    def parse_request(self, body: bytes, chat: bool):
        request = super().parse_request(body, chat)
        request.prompt_tokens = engine_prompt_tokens(orjson.loads(body))
        self.prompt_reports.append(request.prompt_tokens)
        return request


def engine_prompt_tokens(body: dict) -> int:
    parts: list[bytes] = []
    for message in body["messages"]:
        text = message.get("content") or ""
        for call in message.get("tool_calls") or ():
            text += call["function"]["name"] + call["function"]["arguments"]
        text += message.get("tool_call_id", "") + message.get("name", "")
        parts.append(text.encode())
    for extra in ("tools", "response_format"):
        if body.get(extra) is not None:
            parts.append(orjson.dumps(body[extra]))
    return count_prompt_tokens(parts)


# --- 1. a key's spend limit, two replicas ------------------------------------------

STORY_PROMPT_TOKENS = sim_prompt_tokens([{"role": "user", "content": "story 000"}])  # every "story NNN" alike

KEY_LIMIT_USD = "0.005"
KEY_LIMIT_NANO_USD = 5_000_000
# Prices ten times make_fleet's defaults: a request of 100 tokens costs about
# an eighth of the limit, so 40 at once would spend it about five times over.
EXPENSIVE_INPUT_NANO_USD_PER_TOKEN = 1_500
EXPENSIVE_OUTPUT_NANO_USD_PER_TOKEN = 6_000


def test_a_key_spend_limit_holds_against_concurrent_requests_on_two_replicas(postgres_url, cleanup):
    """Given a key limited to $0.005 and two replicas, when 40 streams and then
    100 mixed requests arrive at once, then the key never spends more than its
    limit, refusals are 429 and move nothing, and at least half the limit is used."""
    worker = start_worker(cleanup, build_app("h200", MODEL, time_scale=4.0))
    credits = usd_to_nano_usd("10")
    fleet = make_fleet(postgres_url, [worker.url], credits_usd="10", spend_limit_usd=KEY_LIMIT_USD,
                       input_usd_per_mtok="1.50", output_usd_per_mtok="6.00")
    replicas = start_replicas(cleanup, postgres_url, 2)

    async def main():
        clients = [sdk_client(r, fleet.key) for r in replicas]

        def request(i: int, stream: bool, max_tokens: int):
            client = clients[i % 2]
            messages = [{"role": "user", "content": f"story {i:03d}"}]
            call = sdk_stream if stream else sdk_complete
            return call(client, messages=messages, max_tokens=max_tokens)

        wave_1 = await asyncio.gather(*(request(i, True, 100) for i in range(40)))
        wave_2 = await asyncio.gather(*(request(40 + i, i % 2 == 0, (5, 20, 50, 100)[i % 4]) for i in range(100)))
        for client in clients:
            await client.close()
        return [*wave_1, *wave_2]

    results = asyncio.run(main())
    served = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status != 200]
    assert {r.status for r in refused} <= {429}
    assert all(r.error["type"] == r.error["code"] == "insufficient_quota" for r in refused)
    settled = assert_books_exact(fleet, credits)
    spent = sum(s["charge_nano_usd"] for s in settled)
    assert spent <= KEY_LIMIT_NANO_USD, f"the key spent {spent} nano-USD against a limit of {KEY_LIMIT_NANO_USD}"
    assert spent >= KEY_LIMIT_NANO_USD // 2, "the limit is used, not refused wholesale"
    assert {s["meta"]["api_key_id"] for s in settled} == {fleet.key_id}
    by_id = {s["request_id"]: s for s in settled}
    assert set(by_id) == {r.request_id for r in served if r.tokens}, "only served requests moved money, each once"
    for r in served:
        if r.tokens:
            assert_billed_what_was_received(r, by_id[r.request_id], STORY_PROMPT_TOKENS, input_price=EXPENSIVE_INPUT_NANO_USD_PER_TOKEN,
                                            output_price=EXPENSIVE_OUTPUT_NANO_USD_PER_TOKEN)


# --- 2. a balance, two replicas ----------------------------------------------------


def test_a_balance_holds_against_200_concurrent_requests_on_two_replicas(postgres_url, cleanup):
    """Given credits for about 20 requests and two replicas, when 200 stream at
    once, then available never goes below zero and each completed request is
    charged exactly once, for what its caller received."""
    worker = start_worker(cleanup, build_app("h200", MODEL, time_scale=4.0))
    credits = 600_000  # a request of 40 tokens costs 24,900 and holds 28,950
    fleet = make_fleet(postgres_url, [worker.url], credits_usd="0.0006")
    replicas = start_replicas(cleanup, postgres_url, 2)
    stop, lowest = threading.Event(), []

    def watch():
        while not stop.is_set():
            lowest.append(fleet.balance(fleet.customer_id).available_nano_usd)

    async def main():
        clients = [sdk_client(r, fleet.key) for r in replicas]
        results = await asyncio.gather(*(
            sdk_stream(clients[i % 2], messages=[{"role": "user", "content": f"story {i:03d}"}], max_tokens=40)
            for i in range(200)))
        for client in clients:
            await client.close()
        return results

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        watcher.join()
    served = [r for r in results if r.status == 200]
    assert {r.status for r in results if r.status != 200} <= {402}
    assert 10 <= len(served) < 200, "credits for about 20: some served, most refused"
    assert min(lowest) >= 0, "available went below zero"
    settled = assert_books_exact(fleet, credits)
    by_id = {s["request_id"]: s for s in settled}
    assert set(by_id) == {r.request_id for r in served if r.tokens}, "each completed request charged exactly once"
    for r in served:
        if r.tokens:
            assert r.done
            assert_billed_what_was_received(r, by_id[r.request_id], STORY_PROMPT_TOKENS)


# --- 3. streams longer than the hold's TTL ----------------------------------------

HOLD_TTL_S = 5
LONG_STREAM_TOKENS = 250  # about 15 s at 17 tokens a second: three hold TTLs


def test_a_request_that_outlives_its_hold_ttl_is_billed_for_every_token(postgres_url, cleanup):
    """Given holds that live 5 s and a sweeper every 0.5 s, when a streaming
    and a non-streaming request each run about 15 s, then the caller gets every
    token and [DONE] and pays exactly for them, and nothing stays held."""
    worker = start_worker(cleanup, build_app("h200", MODEL, time_scale=0.1))  # about 17 tokens a second
    credits = usd_to_nano_usd("10")
    fleet = make_fleet(postgres_url, [worker.url])
    [replica] = start_replicas(cleanup, postgres_url, 1, PARALON_HOLD_TTL_S=str(HOLD_TTL_S),
                               PARALON_HOLD_SWEEP_INTERVAL_MS="500")
    streamed_messages = [{"role": "user", "content": "a long story, streamed"}]
    whole_messages = [{"role": "user", "content": "a long story, whole"}]

    async def main():
        started = time.monotonic()
        async with httpx.AsyncClient() as http:
            client = sdk_client(replica, fleet.key)
            streamed, whole = await asyncio.gather(
                raw_stream(http, replica.url, fleet.key, {"model": MODEL, "messages": streamed_messages,
                                                          "max_tokens": LONG_STREAM_TOKENS,
                                                          "stream_options": {"include_usage": True}}),
                sdk_complete(client, messages=whole_messages, max_tokens=LONG_STREAM_TOKENS))
            await client.close()
        return streamed, whole, time.monotonic() - started

    streamed, whole, elapsed_s = asyncio.run(main())
    assert elapsed_s > 2 * HOLD_TTL_S, "the requests outlived their holds"
    for received in (streamed, whole):
        assert received.status == 200 and received.error is None and received.done
        assert received.tokens == LONG_STREAM_TOKENS, "every token reached the caller"
    settled = assert_books_exact(fleet, credits)
    by_id = {s["request_id"]: s for s in settled}
    assert streamed.cost_nano_usd == charge_of(sim_prompt_tokens(streamed_messages), LONG_STREAM_TOKENS) > 0
    assert whole.cost_nano_usd == charge_of(sim_prompt_tokens(whole_messages), LONG_STREAM_TOKENS) > 0
    assert set(by_id) == {streamed.request_id, whole.request_id}
    assert_billed_what_was_received(streamed, by_id[streamed.request_id], sim_prompt_tokens(streamed_messages))
    assert_billed_what_was_received(whole, by_id[whole.request_id], sim_prompt_tokens(whole_messages))


# --- 4. body fields the worker would obey -----------------------------------------

HOSTILE_MAX_TOKENS = 8
HOSTILE_BODIES = (  # (streaming, extra fields); sent in this order by one account
    (True, {"sim_inflate_usage": 10}),
    (False, {"sim_inflate_usage": 10}),
    (True, {"sim_fail_after_tokens": 5}),
    (False, {"sim_extra_tokens": 50, "paralon_debug": True}),
    (True, {"sim_inflate_usage": 10, "sim_fail_after_tokens": 5, "sim_extra_tokens": 50, "x_trace": "abc"}),
    (False, {"sim_inflate_usage": 10, "worker_override": {"url": "http://127.0.0.1:9"}}),
    (True, {"sim_tokens": 0, "paralon_debug": {"strikes": 3}}),
)


def test_body_fields_no_engine_documents_never_reach_the_worker(postgres_url, cleanup):
    """Given an honest worker that would obey the simulator's test fields, when
    one account sends them (and junk) in seven requests, then none arrives, the
    worker behaves honestly, nobody records a discrepancy or a strike, the
    worker stays active and the caller pays exactly for what it received."""
    recorder = RecordingSimWorker()
    worker = start_worker(cleanup, recorder)
    credits = usd_to_nano_usd("10")
    fleet = make_fleet(postgres_url, [worker.url])
    [replica] = start_replicas(cleanup, postgres_url, 1)

    async def main():
        results = []
        async with httpx.AsyncClient() as http:
            client = sdk_client(replica, fleet.key)
            for i, (stream, fields) in enumerate(HOSTILE_BODIES):
                messages = [{"role": "user", "content": f"hostile {i}"}]
                if stream:
                    body = {"model": MODEL, "messages": messages, "max_tokens": HOSTILE_MAX_TOKENS,
                            "stream_options": {"include_usage": True}, **fields}
                    results.append((messages, await raw_stream(http, replica.url, fleet.key, body)))
                else:
                    results.append((messages, await sdk_complete(client, messages=messages, max_tokens=HOSTILE_MAX_TOKENS,
                                                                 extra_body=fields)))
            await client.close()
        return results

    results = asyncio.run(main())
    worker_view = fleet.worker(fleet.worker_ids[0])
    arrived = sorted({f for body in recorder.bodies for f in body if f in HOSTILE_FIELDS})
    observed = {
        "fields that reached the worker": arrived,
        "statuses": [r.status for _, r in results],
        "failed streams": sum(1 for _, r in results if r.error is not None or not r.done),
        "tokens received": [r.tokens for _, r in results],
        "UsageDiscrepancyRecorded": fleet.events("UsageDiscrepancyRecorded"),
        "strikes": worker_view.usage_strikes,
        "worker state": worker_view.state,
    }
    assert observed == {
        "fields that reached the worker": [],
        "statuses": [200] * len(HOSTILE_BODIES),
        "failed streams": 0,
        "tokens received": [HOSTILE_MAX_TOKENS] * len(HOSTILE_BODIES),
        "UsageDiscrepancyRecorded": 0,
        "strikes": 0,
        "worker state": "active",
    }
    settled = assert_books_exact(fleet, credits)
    by_id = {s["request_id"]: s for s in settled}
    assert set(by_id) == {r.request_id for _, r in results}
    for messages, received in results:
        assert_billed_what_was_received(received, by_id[received.request_id], sim_prompt_tokens(messages))


# --- 5. a revoked key --------------------------------------------------------------


def test_a_revoked_key_is_refused_at_once_by_every_replica(postgres_url, cleanup):
    """Given two replicas that cache keys for 60 s and a key used on both, when
    the customer revokes it through the management API of one, then the very
    next request on the other is 401 and moves no money."""
    worker = start_worker(cleanup, build_app("instant", MODEL))
    credits = usd_to_nano_usd("10")
    fleet = make_fleet(postgres_url, [worker.url])
    with fleet.engine.begin() as conn:
        _, token = create_token(conn, fleet.customer_id, "customer")
    first, other = start_replicas(cleanup, postgres_url, 2, PARALON_KEY_CACHE_TTL_MS="60000")
    messages = [{"role": "user", "content": "hello"}]

    async def request(replica) -> Received:
        client = sdk_client(replica, fleet.key)
        try:
            return await sdk_complete(client, messages=messages, max_tokens=3)
        finally:
            await client.close()

    assert [asyncio.run(request(r)).status for r in (first, other)] == [200, 200], "the key works on both"
    assert wait_until_nothing_held(fleet) == 0
    customer_before = fleet.balance(fleet.customer_id).balance_nano_usd
    settled_before = len(fleet.settlements())

    revoked = httpx.delete(f"{first.url}/v1/keys/{fleet.key_id}", headers={"authorization": f"Bearer {token}"}, timeout=10)
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    time.sleep(REVOCATION_REACH_S)
    after_on_other, after_on_first = asyncio.run(request(other)), asyncio.run(request(first))

    assert (after_on_other.status, after_on_first.status) == (401, 401), "a revoked key is refused everywhere"
    assert after_on_other.error["type"] == "authentication_error"
    assert len(fleet.settlements()) == settled_before, "no money moved after the revocation"
    assert fleet.balance(fleet.customer_id).balance_nano_usd == customer_before
    settled = assert_books_exact(fleet, credits)
    assert len(settled) == 2


# --- 6. callers that leave mid-stream ---------------------------------------------

LEAVING_CALLERS = 30
LEAVING_MAX_TOKENS = 60


def test_callers_that_leave_mid_stream_pay_for_what_they_received(postgres_url, cleanup):
    """Given 30 concurrent streams that each leave after a random number of
    tokens, then each is charged for what it received, plus at most 2 tokens
    that were on their way, and the owner is paid 80% of each charge."""
    # With 30 streams running, an h200 at time scale 0.05 sends a token about every 270 ms
    # (75 tok/s / 0.05 slower): a loaded CI machine still notices a caller leaving within 2.
    worker = start_worker(cleanup, build_app("h200", MODEL, time_scale=0.05))
    credits = usd_to_nano_usd("10")
    fleet = make_fleet(postgres_url, [worker.url])
    [replica] = start_replicas(cleanup, postgres_url, 1)
    fleet.await_routable()
    leave_after = [random.Random(i).randint(1, LEAVING_MAX_TOKENS - 10) for i in range(LEAVING_CALLERS)]
    messages = [[{"role": "user", "content": f"leaving {i:02d}"}] for i in range(LEAVING_CALLERS)]

    async def main():
        client = sdk_client(replica, fleet.key)
        results = await asyncio.gather(*(
            sdk_stream(client, messages=messages[i], max_tokens=LEAVING_MAX_TOKENS, leave_after_tokens=leave_after[i])
            for i in range(LEAVING_CALLERS)))
        await client.close()
        return results

    results = asyncio.run(main())
    assert [r.tokens for r in results] == leave_after, "each caller left where it meant to"
    deadline = time.monotonic() + SETTLED_WAIT_S
    while len(fleet.settlements()) < LEAVING_CALLERS and time.monotonic() < deadline:
        time.sleep(0.05)
    settled = assert_books_exact(fleet, credits)
    by_id = {s["request_id"]: s for s in settled}
    assert set(by_id) == {r.request_id for r in results}, "every caller that received tokens is billed, once"
    for i, received in enumerate(results):
        settlement = by_id[received.request_id]
        billed = settlement["meta"]["completion_tokens"]
        assert received.tokens <= billed <= received.tokens + DISCONNECT_TOLERANCE_TOKENS, (i, received.tokens, billed)
        assert settlement["charge_nano_usd"] == charge_of(sim_prompt_tokens(messages[i]), billed)
        assert settlement["owner_nano_usd"] == settlement["charge_nano_usd"] * OWNER_SHARE_PERCENT // 100


# --- 7. agent conversations --------------------------------------------------------

AGENT_REQUESTS = 20
TOOL_ARGUMENTS_BYTES = 3_000
AGENT_MAX_TOKENS = 12
READ_TABLE_TOOL = {"type": "function", "function": {
    "name": "read_table", "description": "Read rows of a table",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "filter": {"type": "string"}},
                   "required": ["path"]}}}
SUMMARY_FORMAT = {"type": "json_schema", "json_schema": {
    "name": "summary", "strict": True,
    "schema": {"type": "object", "properties": {"rows": {"type": "integer"}, "verdict": {"type": "string"}},
               "required": ["rows", "verdict"], "additionalProperties": False}}}


def tool_arguments(i: int) -> str:
    """JSON arguments of exactly TOOL_ARGUMENTS_BYTES bytes, as an agent writes them."""
    head = orjson.dumps({"path": f"/srv/tables/orders_{i:02d}.csv", "filter": ""})
    return orjson.dumps({"path": f"/srv/tables/orders_{i:02d}.csv",
                         "filter": "x" * (TOOL_ARGUMENTS_BYTES - len(head))}).decode()


def agent_conversation(i: int) -> dict:
    call_id = f"call_{i:02d}"
    arguments = tool_arguments(i)
    assert len(arguments.encode()) == TOOL_ARGUMENTS_BYTES
    return {
        "messages": [
            {"role": "system", "content": "You are a data agent. Answer in JSON."},
            {"role": "user", "content": f"How many open orders are in table {i}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "read_table", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "name": "read_table", "content": "rows: 120, open: 17"},
            {"role": "user", "content": "Give the summary."},
        ],
        "tools": [READ_TABLE_TOOL],
        "response_format": SUMMARY_FORMAT,
    }


def test_agent_conversations_bill_the_honest_prompt_and_strike_nobody(postgres_url, cleanup):
    """Given an honest worker that counts every byte its chat template sees,
    when 20 agent conversations (a tool call with 3,000 bytes of arguments, a
    tool reply, tool definitions, a JSON schema) run through the proxy, then
    the billed prompt is the worker's report, with no discrepancy and no strike."""
    recorder = TemplateCountingWorker()
    worker = start_worker(cleanup, recorder)
    credits = usd_to_nano_usd("10")
    fleet = make_fleet(postgres_url, [worker.url])
    [replica] = start_replicas(cleanup, postgres_url, 1)

    async def main():
        results = []
        async with httpx.AsyncClient() as http:
            client = sdk_client(replica, fleet.key)
            for i in range(AGENT_REQUESTS):
                conversation = agent_conversation(i)
                if i % 2:
                    received = await sdk_complete(client, max_tokens=AGENT_MAX_TOKENS, **conversation)
                else:
                    body = {"model": MODEL, "max_tokens": AGENT_MAX_TOKENS, "stream_options": {"include_usage": True},
                            **conversation}
                    received = await raw_stream(http, replica.url, fleet.key, body)
                results.append((conversation, received))
            await client.close()
        return results

    results = asyncio.run(main())
    worker_view = fleet.worker(fleet.worker_ids[0])
    honest = recorder.prompt_reports  # one report per request, in order: they ran one after another
    assert min(honest) >= TOOL_ARGUMENTS_BYTES // 4, "the worker counted the tool call's arguments"
    observed = {
        "statuses": [r.status for _, r in results],
        "billed prompt tokens": [(r.usage or {}).get("prompt_tokens") for _, r in results],
        "UsageDiscrepancyRecorded": fleet.events("UsageDiscrepancyRecorded"),
        "strikes": worker_view.usage_strikes,
        "worker state": worker_view.state,
    }
    assert observed == {
        "statuses": [200] * AGENT_REQUESTS,
        "billed prompt tokens": honest,
        "UsageDiscrepancyRecorded": 0,
        "strikes": 0,
        "worker state": "active",
    }
    settled = assert_books_exact(fleet, credits)
    by_id = {s["request_id"]: s for s in settled}
    assert set(by_id) == {r.request_id for _, r in results}
    for (_, received), prompt_tokens in zip(results, honest, strict=True):
        assert received.tokens == AGENT_MAX_TOKENS
        assert_billed_what_was_received(received, by_id[received.request_id], prompt_tokens)
