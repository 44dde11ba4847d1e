"""A GPU owner who lies: hand-written workers that split, pad, repeat,
duplicate, inflate or die, driven through a real `paralon serve` with the
official SDK. What the caller received is counted here, independently of the
proxy; billing must never exceed it (UTF-8 bytes of text, tool-call names and
arguments, and reasoning, plus the documented allowance for stop tokens and
tool-call markup that engines strip, `received_bound`), nor
what the worker reported; a report above that bound is evidence against the
worker, and three of them suspend it."""
from __future__ import annotations

import time
from dataclasses import dataclass

import openai
import orjson
import pytest
from sqlalchemy import select

from ledger import accounts as acc
from ledger import commands as cmd
from ledger.money import usd_to_nano_usd
from ledger.schema import accounts, ledger_events
from ledger.service import append_now
from proxy import keys, limits, metering
from tests.support.harness import MODEL, make_fleet, serving, wait_for
from tests.support.hostile_worker import (
    DIE_AFTER_WORDS,
    DIES_MID_STREAM,
    DUPLICATE_CHOICES,
    EMPTY_PADDING,
    HONEST,
    INFLATE_BOTH,
    INFLATE_WITHOUT_FINISH,
    INFLATE_COMPLETION,
    INFLATE_PROMPT,
    PROMPT_AT_BOUND,
    REASONING_PADDING,
    REPEATS,
    SPLIT_CHOICES,
    THINK_MARK,
    TOOL_CALL_PADDING,
    WORDS,
    start_hostile_worker,
)

INPUT_NANO_USD_PER_TOKEN, OUTPUT_NANO_USD_PER_TOKEN = 150, 600  # make_fleet's $0.15 and $0.60 per MTok
MAX_TOKENS = 500
STRIKES_TO_SUSPEND = 3
SETTLED_WAIT_S = 10.0
DIRECTORY_REFRESH_WAIT_S = 2.5  # every replica rereads the fleet at least once a second
CUSTOMER_CREDITS_USD = "10"
# Chunks or choices with the same index in one chunk are malformed whatever usage comes with them.
MALFORMED = {SPLIT_CHOICES, DUPLICATE_CHOICES}
# Each of these reports more than the bound: completion tokens above the bytes relayed, or the prompt above its bound.
ABOVE_THE_BOUND = {TOOL_CALL_PADDING, EMPTY_PADDING, INFLATE_COMPLETION, INFLATE_PROMPT, INFLATE_BOTH, INFLATE_WITHOUT_FINISH}
# A byte bound cannot tell these from an honest worker: the caller really received that many bytes.
WITHIN_THE_BOUND = {REASONING_PADDING, REPEATS, PROMPT_AT_BOUND}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the documentation.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["query"]}}}
ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer"]}}}


@pytest.fixture
def start_worker():
    """Hand-written workers on uvicorn threads, all stopped when the test ends."""
    started = []

    def start(behaviour: str, **options):
        server = start_hostile_worker(behaviour, **options)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@dataclass
class Received:
    """What one caller got, counted from the SDK's objects, not from the proxy's usage."""

    request_id: str | None = None
    text_bytes: int = 0
    tool_bytes: int = 0  # tool-call names and arguments
    reasoning_bytes: int = 0
    chunks: int = 0
    chunks_with_repeated_index: int = 0
    tool_call_names: int = 0  # tool-call names received (the start of each call)
    usage: object = None  # the usage the proxy reported to the caller
    status: int = 200
    error_after_tokens: openai.APIError | None = None

    @property
    def output_bytes(self) -> int:
        return self.text_bytes + self.tool_bytes + self.reasoning_bytes

    def add_chunk(self, chunk) -> None:
        self.request_id, self.chunks = chunk.id, self.chunks + 1
        if chunk.usage is not None:
            self.usage = chunk.usage
        indexes = [choice.index for choice in chunk.choices]
        if len(indexes) != len(set(indexes)):
            self.chunks_with_repeated_index += 1
        for choice in chunk.choices:
            self._add_output(choice.delta)

    def add_answer(self, answer) -> None:
        self.request_id, self.usage = answer.id, answer.usage
        for choice in answer.choices:
            self._add_output(choice.message)

    def _add_output(self, part) -> None:
        self.text_bytes += len((part.content or "").encode())
        self.reasoning_bytes += len((getattr(part, "reasoning_content", None) or "").encode())
        for call in part.tool_calls or ():
            function = getattr(call, "function", None)
            if function is not None:
                self.tool_bytes += len((function.name or "").encode()) + len((function.arguments or "").encode())
                self.tool_call_names += bool(function.name)

    def received_bound(self) -> int:
        """Tokens no byte-level tokenizer exceeds for what was received, with
        the proxy's documented allowance for what engines strip: the stop
        token(s) of an answer and the markup around each tool call."""
        return (self.output_bytes + limits.COMPLETION_ALLOWANCE_TOKENS_PER_FINISH
                + self.tool_call_names * limits.COMPLETION_ALLOWANCE_TOKENS_PER_TOOL_CALL)


def stream_chat(client: openai.OpenAI, messages: list[dict], **options) -> Received:
    got = Received()
    try:
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True,
                                                stream_options={"include_usage": True}, **options)
        for chunk in stream:
            got.add_chunk(chunk)
    except openai.APIStatusError as exc:
        got.status = exc.status_code
    except openai.APIError as exc:  # an error event after tokens
        got.error_after_tokens = exc
    return got


def ask_chat(client: openai.OpenAI, messages: list[dict], **options) -> Received:
    got = Received()
    try:
        got.add_answer(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, **options))
    except openai.APIStatusError as exc:
        got.status = exc.status_code
    return got


def add_customer(fleet, name: str) -> tuple[int, str]:
    """Another customer with credits and a key of its own."""
    with fleet.engine.begin() as conn:
        customer = acc.create_account(conn, cmd.CUSTOMER, name, f"{name.replace(' ', '-')}@example.com")
        _, key = keys.create_key(conn, customer)
    append_now(fleet.engine, cmd.GrantCredits(customer, usd_to_nano_usd(CUSTOMER_CREDITS_USD), "test credits",
                                              f"grant:{customer}"))
    return customer, key


def platform_balance(fleet) -> int:
    with fleet.engine.connect() as conn:
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == cmd.PLATFORM_REVENUE_ACCOUNT)).scalar_one()
    return fleet.balance(platform).balance_nano_usd


def discrepancy_request_ids(fleet) -> set[str]:
    with fleet.engine.connect() as conn:
        rows = conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == "UsageDiscrepancyRecorded"))
        return {orjson.loads(row.payload)["request_id"] for row in rows}


def eventually(predicate, timeout_s: float) -> bool:
    """Like wait_for, but the test goes on to say what is wrong when it is not reached."""
    try:
        return bool(wait_for(predicate, timeout_s=timeout_s))
    except AssertionError:
        return False


def settled_by_request(fleet) -> dict[str, dict]:
    return {s["request_id"]: s for s in fleet.settlements()}


class Books:
    """Balances before, to prove afterwards that exactly the settled charges moved."""

    def __init__(self, fleet, customers: list[int]) -> None:
        self.fleet, self.customers = fleet, customers
        self.before = {c: fleet.balance(c).balance_nano_usd for c in customers}
        self.platform_before = platform_balance(fleet)

    def assert_exact(self) -> None:
        fleet = self.fleet
        settled = fleet.settlements()
        for customer in self.customers:
            after = fleet.balance(customer)
            charged = sum(s["charge_nano_usd"] for s in settled if s["customer_account_id"] == customer)
            assert self.before[customer] - after.balance_nano_usd == charged, "the customer lost exactly its charges"
            assert after.held_nano_usd == 0, "nothing held at the end"
        owners = sum(fleet.balance(o).balance_nano_usd for o in fleet.owner_ids)
        assert owners == sum(s["charge_nano_usd"] * 80 // 100 for s in settled)
        platform = sum(s["charge_nano_usd"] - s["charge_nano_usd"] * 80 // 100 for s in settled)
        assert platform_balance(fleet) - self.platform_before == platform
        fleet.assert_books_close()


def assert_billed_within_what_was_received(got: Received, settlement: dict, record) -> None:
    billed = settlement["meta"]
    assert billed["completion_tokens"] <= got.received_bound(), (
        f"billed {billed['completion_tokens']} completion tokens for {got.output_bytes} bytes received")
    assert billed["completion_tokens"] <= record.reported_completion_tokens, "never more than the worker reported"
    assert billed["prompt_tokens"] <= record.reported_prompt_tokens, "never more than the worker reported"
    assert settlement["charge_nano_usd"] == (billed["prompt_tokens"] * INPUT_NANO_USD_PER_TOKEN
                                             + billed["completion_tokens"] * OUTPUT_NANO_USD_PER_TOKEN)


def reported_above_the_bound(got: Received, record) -> bool:
    prompt_bound = metering.prompt_tokens_bound("chat", record.body)
    bound = got.received_bound()
    tolerance = max(limits.COMPLETION_TOLERANCE_TOKENS_MIN, bound * limits.COMPLETION_TOLERANCE_PERCENT // 100)
    return (record.reported_completion_tokens > bound + tolerance
            or record.reported_prompt_tokens > prompt_bound)


@pytest.mark.parametrize("behaviour", sorted(MALFORMED | ABOVE_THE_BOUND | WITHIN_THE_BOUND))
def test_a_dishonest_worker_is_billed_at_most_what_the_caller_received(database_url, start_worker, behaviour):
    """Given one worker with a dishonest way of chunking or reporting, when
    three customers each stream one answer from it, then each is billed at
    most the bytes it received (and the worker's report), exactly priced;
    a report above that bound, or a malformed stream, is a strike with its
    evidence, three strikes suspend the worker and the next caller gets 503
    with nothing held. Three accounts, so that no rule about several
    callers can excuse the worker."""
    worker = start_worker(behaviour)
    fleet = make_fleet(database_url, [worker.url], credits_usd=CUSTOMER_CREDITS_USD)
    callers = [(fleet.customer_id, fleet.key)] + [add_customer(fleet, f"customer {i}") for i in (2, 3)]
    books = Books(fleet, [customer for customer, _ in callers])
    worker_id = fleet.worker_ids[0]
    with serving(database_url) as proxy:
        clients = [openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0) for _, key in callers]
        received = {}
        # Prompt inflation alone proves nothing on one request (a caller might
        # have caused it): each strike takes it on requests of three accounts.
        rounds = STRIKES_TO_SUSPEND if behaviour == INFLATE_PROMPT else 1
        for i, client in [(i, c) for _ in range(rounds) for i, c in enumerate(clients)]:
            marker = f"{behaviour} request {len(received)} from {i}"
            received[marker] = stream_chat(client, [{"role": "user", "content": f"Tell me about mats ({marker})."}])
        if behaviour not in WITHIN_THE_BOUND:
            eventually(lambda: fleet.worker(worker_id).state == "suspended", SETTLED_WAIT_S)
        time.sleep(DIRECTORY_REFRESH_WAIT_S)
        requests_before = len(worker.app.received)
        after = stream_chat(clients[0], [{"role": "user", "content": "One more, please (after)."}])
        fleet.pools_released()  # by the replica, idle: none left for its shutdown to release

    settled = settled_by_request(fleet)
    discrepancies = discrepancy_request_ids(fleet)
    for marker, got in received.items():
        assert got.status == 200 and got.error_after_tokens is None and got.request_id in settled, marker
        record = worker.app.record_for(marker)
        assert_billed_within_what_was_received(got, settled[got.request_id], record)
        assert got.chunks_with_repeated_index == 0, "a choice index appears once per chunk: duplicates are dropped"
        if reported_above_the_bound(got, record):
            assert got.request_id in discrepancies, f"{marker}: a report above the bound is recorded as evidence"
    state = fleet.worker(worker_id)
    if behaviour in WITHIN_THE_BOUND:  # the bytes were received: billing them proves nothing either way
        if state.state == "suspended":
            assert after.status == 503 and len(worker.app.received) == requests_before
        else:
            assert after.status == 200 and after.request_id in settled_by_request(fleet)
    else:
        assert state.usage_strikes >= STRIKES_TO_SUSPEND, "each request was a strike"
        assert state.state == "suspended"
        assert after.status == 503, "no traffic to a suspended worker"
        assert len(worker.app.received) == requests_before
    books.assert_exact()


def test_a_worker_that_dies_mid_stream_is_paid_for_what_the_caller_received(database_url, start_worker):
    """Given a worker that reports honest usage on every chunk and dies after
    a few words, when a caller streams from it, then the caller gets those
    words and then an error event, is charged exactly for them and for the
    prompt, and the owner is paid 80% of that."""
    worker = start_worker(DIES_MID_STREAM)
    fleet = make_fleet(database_url, [worker.url])
    books = Books(fleet, [fleet.customer_id])
    with serving(database_url) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        got = stream_chat(client, [{"role": "user", "content": "Tell me a story (dying)."}])
        settled = wait_for(lambda: settled_by_request(fleet).get(got.request_id), timeout_s=SETTLED_WAIT_S)
    record = worker.app.record_for("dying")
    assert got.error_after_tokens is not None, "the caller is told the stream failed, after the tokens"
    assert got.text_bytes == len("".join(WORDS[:DIE_AFTER_WORDS]).encode())
    assert settled["meta"]["completion_tokens"] == DIE_AFTER_WORDS, "billed the tokens the caller received"
    assert settled["meta"]["prompt_tokens"] == record.reported_prompt_tokens == record.honest_prompt_tokens
    charge = record.honest_prompt_tokens * INPUT_NANO_USD_PER_TOKEN + DIE_AFTER_WORDS * OUTPUT_NANO_USD_PER_TOKEN
    assert settled["charge_nano_usd"] == charge
    assert fleet.balance(fleet.owner_ids[0]).balance_nano_usd == charge * 80 // 100
    assert discrepancy_request_ids(fleet) == set() and fleet.worker(fleet.worker_ids[0]).usage_strikes == 0
    books.assert_exact()


def _agent_conversation(i: int) -> list[dict]:
    """A history with an assistant tool call (a few KB of arguments), its tool reply, and a question."""
    arguments = orjson.dumps({"query": f"mats {i}", "notes": "warm woollen mat " * (180 + 20 * (i % 5))}).decode()
    return [
        {"role": "system", "content": "You are a documentation assistant."},
        {"role": "user", "content": f"Find the mats page (agent {i})."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "search_docs", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": "Mats: " + "woollen, warm, washable. " * (5 + i % 7)},
        {"role": "user", "content": f"Summarise it (agent {i})."},
    ]


def _mixed_request(client: openai.OpenAI, i: int) -> tuple[str, Received]:
    """Plain chat, streamed or not; a tool call offered; an agent history with
    a tool reply; reasoning; structured output."""
    marker = f"mixed {i}"
    kind = i % 6
    if kind == 0:
        return marker, stream_chat(client, [{"role": "user", "content": f"Hello ({marker})"}], temperature=0.2)
    if kind == 1:
        return marker, ask_chat(client, [{"role": "user", "content": f"Hello, whole answer ({marker})"}])
    if kind == 2:
        return marker, stream_chat(client, [{"role": "user", "content": f"Look it up ({marker})"}], tools=[SEARCH_TOOL],
                                   tool_choice="auto")
    if kind == 3:
        history = _agent_conversation(i)
        history[-1]["content"] += f" ({marker})"
        return marker, stream_chat(client, history, tools=[SEARCH_TOOL])
    if kind == 4:
        return marker, stream_chat(client, [{"role": "user", "content": f"Please {THINK_MARK} first ({marker})"}])
    return marker, ask_chat(client, [{"role": "user", "content": f"Answer as JSON ({marker})"}], response_format=ANSWER_SCHEMA)


def test_an_honest_worker_serving_50_mixed_requests_gets_no_strike(database_url, start_worker):
    """Given an honest worker, when it serves 50 mixed requests (chat, tool
    calls, agent histories with tool replies, reasoning, structured output),
    then each is billed exactly what the worker reported, which is within
    what the caller received, there is no discrepancy and no strike."""
    worker = start_worker(HONEST)
    fleet = make_fleet(database_url, [worker.url])
    books = Books(fleet, [fleet.customer_id])
    with serving(database_url) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        received = dict(_mixed_request(client, i) for i in range(50))
    settled = settled_by_request(fleet)
    for marker, got in received.items():
        assert got.status == 200 and got.error_after_tokens is None, marker
        record = worker.app.record_for(marker)
        settlement = settled[got.request_id]
        assert_billed_within_what_was_received(got, settlement, record)
        assert (settlement["meta"]["prompt_tokens"], settlement["meta"]["completion_tokens"]) == (
            record.reported_prompt_tokens, record.reported_completion_tokens), f"{marker}: an honest report is billed as is"
    assert {r.body.get("stream") for r in worker.app.received} == {True}, "the proxy always streams upstream"
    assert discrepancy_request_ids(fleet) == set()
    state = fleet.worker(fleet.worker_ids[0])
    assert state.usage_strikes == 0 and state.state == "active"
    books.assert_exact()


def test_a_tool_call_answered_without_streaming_reaches_the_caller_it_is_billed_to(database_url, start_worker):
    """Given an honest worker that answers with a tool call, when the caller
    does not stream, then it receives the tool call it is billed for."""
    worker = start_worker(HONEST)
    fleet = make_fleet(database_url, [worker.url])
    books = Books(fleet, [fleet.customer_id])
    with serving(database_url) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        got = ask_chat(client, [{"role": "user", "content": "Look it up (whole tool call)"}], tools=[SEARCH_TOOL])
    record = worker.app.record_for("whole tool call")
    assert got.status == 200 and got.tool_bytes > 0, "the tool call the worker produced reaches the caller"
    assert_billed_within_what_was_received(got, settled_by_request(fleet)[got.request_id], record)
    books.assert_exact()


def test_only_documented_engine_fields_reach_the_worker(database_url, start_worker):
    """Given a caller sending OpenAI's and vLLM's documented parameters and
    fields no engine documents, then the worker receives the former only."""
    worker = start_worker(HONEST)
    fleet = make_fleet(database_url, [worker.url])
    books = Books(fleet, [fleet.customer_id])
    with serving(database_url) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        got = stream_chat(client, [{"role": "user", "content": "Fields (documented)"}], temperature=0.3, top_p=0.9,
                          seed=7, stop=["END"], response_format=ANSWER_SCHEMA,
                          extra_body={"top_k": 20, "repetition_penalty": 1.05, "min_tokens": 1,
                                      "sim_fail_after_tokens": 3, "x_made_up_field": {"a": 1}})
    body = worker.app.record_for("documented").body
    assert got.status == 200
    for documented in ("temperature", "top_p", "seed", "stop", "response_format", "top_k", "repetition_penalty",
                       "min_tokens", "max_tokens", "messages"):
        assert documented in body, f"{documented} is forwarded"
    assert "sim_fail_after_tokens" not in body and "x_made_up_field" not in body, "undocumented fields are dropped"
    books.assert_exact()
