"""The Responses API end to end: the official `openai` SDK (sync and async,
create, stream=True and the stream helper, function tools with a follow-up
through previous_response_id) against `paralon serve` in front of simulated
vLLM workers, billed exactly as chat is; and hostile workers and callers,
each failure with exact balances."""
from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest

from ledger import accounts as acc
from ledger import commands as cmd
from ledger.money import usd_to_nano_usd
from ledger.schema import utc_now
from ledger.service import append_now
from proxy import keys
from proxy.limits import COMPLETION_ALLOWANCE_TOKENS_PER_FINISH
from proxy.prices import Price
from proxy.responses.request import RESPONSES, read_request
from proxy.responses.stream import ResponsesGeneration
from proxy.schema import workers
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for

INPUT_NANO_USD, OUTPUT_NANO_USD = 150, 600  # per token, at make_fleet's prices
TOOLS = [{"type": "function", "name": "lookup", "description": "Look a word up.",
          "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}]


@pytest.fixture
def start_worker():
    started = []

    def start(profile: str = "instant", **options):
        started.append(sim_worker(profile, **options))
        return started[-1]

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def fleet_of(database_url):
    fleets = []

    def make(*worker_urls, **options):
        fleets.append(make_fleet(database_url, list(worker_urls), **options))
        return fleets[-1]

    yield make
    for fleet in fleets:
        fleet.engine.dispose()


def _client(fleet, proxy, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key or fleet.key, max_retries=0)


def _headers(fleet, key=None) -> dict:
    return {"authorization": f"Bearer {key or fleet.key}"}


def _events(response: httpx.Response) -> list[dict]:
    return [orjson.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


def _charge(usage) -> int:
    return usage.input_tokens * INPUT_NANO_USD + usage.output_tokens * OUTPUT_NANO_USD


def _assert_paid(fleet, before_nano_usd: int) -> list[dict]:
    """The customer paid exactly the settled charges, nothing is held (once
    the pools are released), owners got 80%."""
    fleet.pools_released()
    settled = fleet.settlements()
    after = fleet.balance(fleet.customer_id)
    assert after.held_nano_usd == 0
    assert after.balance_nano_usd == before_nano_usd - sum(s["charge_nano_usd"] for s in settled)
    fleet.assert_books_close()
    return settled


def test_the_sdk_creates_and_streams_responses_billed_like_chat(database_url, start_worker, fleet_of):
    worker = start_worker(stop_after_tokens=5)
    fleet = fleet_of(worker.url)
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    with serving(database_url) as proxy:
        client = _client(fleet, proxy)
        raw = client.responses.with_raw_response.create(model=MODEL, input="Say something.", instructions="Be brief.",
                                                        max_output_tokens=50)
        answer = raw.parse()
        cost_nano_usd = int(raw.headers["x-paralon-cost-nano-usd"])
        body = orjson.loads(raw.http_response.content)

        stream = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Say something else."}]}], max_output_tokens=50, stream=True))

        with client.responses.stream(model=MODEL, input="And once more.", max_output_tokens=50) as helper:
            deltas = [event.delta for event in helper if event.type == "response.output_text.delta"]
            final = helper.get_final_response()
    assert answer.status == "completed" and answer.output_text.strip() and answer.model == MODEL
    assert answer.id.startswith("resp_") and raw.headers["x-request-id"] == answer.id
    assert answer.usage.output_tokens == 5 and cost_nano_usd == _charge(answer.usage)
    assert answer.usage.total_tokens == answer.usage.input_tokens + 5
    assert f'"cost":0.{cost_nano_usd:09d}'.encode() in raw.http_response.content, "usage.cost is a JSON number"
    assert body["usage"]["cost_details"] == {"nano_usd": cost_nano_usd}

    assert [e.sequence_number for e in stream] == list(range(len(stream)))
    assert stream[0].type == "response.created" and stream[-1].type == "response.completed"
    assert {e.response.id for e in stream if hasattr(e, "response")} == {stream[0].response.id}
    streamed_text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    completed = stream[-1].response
    assert completed.output_text == streamed_text and completed.usage.output_tokens == 5
    assert completed.usage.model_extra["cost_details"]["nano_usd"] == _charge(completed.usage)

    assert final.output_text == "".join(deltas) and len(deltas) == 5 and final.usage.output_tokens == 5

    settled = _assert_paid(fleet, before)
    assert sorted(s["request_id"] for s in settled) == sorted([answer.id, completed.id, final.id])
    assert sum(s["charge_nano_usd"] for s in settled) == sum(_charge(r.usage) for r in (answer, completed, final))
    assert all(s["owner_nano_usd"] == s["charge_nano_usd"] * 80 // 100 for s in settled)


def test_a_function_call_and_its_output_continue_through_previous_response_id(database_url, start_worker, fleet_of):
    """The worker keeps nothing (store: false upstream): the proxy sends the
    whole conversation, so the follow-up's prompt holds the first turn too."""
    worker = start_worker(stop_after_tokens=4)
    fleet = fleet_of(worker.url)
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    with serving(database_url) as proxy:
        client = _client(fleet, proxy)
        first = client.responses.create(model=MODEL, input="What does 'lorem' mean?", tools=TOOLS, max_output_tokens=50)
        [call] = first.output
        follow_up = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=50,
                                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}])

        async def streamed_follow_up():
            async_client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
            async with async_client.responses.stream(model=MODEL, previous_response_id=follow_up.id, input="Thanks. Again?",
                                                     max_output_tokens=50) as stream:
                deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
                third = await stream.get_final_response()
            alone = await async_client.responses.create(model=MODEL, input="Thanks. Again?", max_output_tokens=50)
            return deltas, third, alone

        deltas, third, alone = asyncio.run(streamed_follow_up())
    assert call.type == "function_call" and call.name == "lookup"
    assert set(orjson.loads(call.arguments)) == {"input"}
    assert first.usage.output_tokens == 4
    assert follow_up.output[0].type == "message" and follow_up.output_text.strip()
    assert follow_up.usage.input_tokens > first.usage.input_tokens, "the first turn was sent again"
    assert third.usage.input_tokens > alone.usage.input_tokens and third.output_text == "".join(deltas)
    assert third.previous_response_id == follow_up.id and third.store is True
    _assert_paid(fleet, before)
    assert len(fleet.settlements()) == 4


def test_another_accounts_response_is_not_found_and_costs_nothing(database_url, start_worker, fleet_of):
    worker = start_worker(stop_after_tokens=3)
    fleet = fleet_of(worker.url)
    with fleet.engine.begin() as conn:
        other = acc.create_account(conn, cmd.CUSTOMER, "another customer", "other@example.com")
        _, other_key = keys.create_key(conn, other)
    append_now(fleet.engine, cmd.GrantCredits(other, usd_to_nano_usd("5"), "test credits", f"grant:{other}"))
    with serving(database_url) as proxy:
        mine = _client(fleet, proxy).responses.create(model=MODEL, input="A secret.", max_output_tokens=20)
        fleet.pools_released()  # what the first request's pool held is free again
        before = {account: fleet.balance(account) for account in (fleet.customer_id, other, *fleet.owner_ids)}
        with pytest.raises(openai.NotFoundError) as refused:
            _client(fleet, proxy, other_key).responses.create(model=MODEL, previous_response_id=mine.id, input="Tell me.")
        unknown = httpx.post(proxy.url + "/v1/responses", headers=_headers(fleet),
                             json={"model": MODEL, "previous_response_id": "resp_nothing", "input": "Hi"})
    assert refused.value.code == "response_not_found" and unknown.status_code == 404
    assert {account: fleet.balance(account) for account in before} == before, "nothing moved"
    assert len(fleet.settlements()) == 1


def test_a_worker_reporting_more_output_than_it_relayed_is_billed_at_the_bound(database_url, start_worker, fleet_of):
    """Ten times the tokens: billed at the bytes relayed (plus the finish
    allowance), never at the report, and the report is recorded as evidence."""
    worker = start_worker(stop_after_tokens=5, inflate_usage=10)
    fleet = fleet_of(worker.url)
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    with serving(database_url) as proxy:
        events = list(_client(fleet, proxy).responses.create(model=MODEL, input="Hi", max_output_tokens=50, stream=True))
    relayed_bytes = sum(len(e.delta.encode()) for e in events if e.type == "response.output_text.delta")
    usage = events[-1].response.usage
    assert usage.output_tokens == relayed_bytes + COMPLETION_ALLOWANCE_TOKENS_PER_FINISH < 50
    [settled] = _assert_paid(fleet, before)
    assert settled["meta"]["completion_tokens"] == usage.output_tokens and settled["charge_nano_usd"] == _charge(usage)
    assert fleet.events("UsageDiscrepancyRecorded") == 1


def test_a_caller_leaving_mid_stream_pays_for_what_it_received(database_url, start_worker, fleet_of):
    worker = start_worker("h200", time_scale=1.0)
    fleet = fleet_of(worker.url)
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    received = 0
    with serving(database_url) as proxy:
        body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 400, "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/responses", json=body, headers=_headers(fleet), timeout=30) as response:
            for line in response.iter_lines():
                received += line.startswith("event: response.output_text.delta")
                if received >= 6:
                    break
        wait_for(lambda: worker.app.state.requests_aborted == 1)
        [settled] = wait_for(fleet.settlements)
    produced = settled["meta"]["completion_tokens"]
    assert received <= produced < 400, "billed what was relayed, not max_output_tokens"
    _assert_paid(fleet, before)


def test_a_worker_failing_before_its_first_token_is_retried_elsewhere_at_no_charge(database_url, start_worker, fleet_of):
    good = start_worker(stop_after_tokens=3)
    fleet = fleet_of("http://127.0.0.1:9", good.url)  # port 9: nothing listens
    with fleet.engine.begin() as conn:  # both look healthy to routing until the dead one is probed
        conn.execute(workers.update().values(healthy=True, context_length=32768))
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    with serving(database_url, PARALON_HEALTH_INTERVAL_MS="60000") as proxy:
        client = _client(fleet, proxy)
        answers = [client.responses.create(model=MODEL, input=f"q{i}", max_output_tokens=20, stream=i % 2 == 1)
                   for i in range(4)]
        answers = [a if not isinstance(a, openai.Stream) else list(a)[-1].response for a in answers]
    assert all(a.status == "completed" and a.usage.output_tokens == 3 for a in answers)
    settled = _assert_paid(fleet, before)
    assert len(settled) == 4 and {s["owner_account_id"] for s in settled} == {fleet.owner_ids[1]}
    assert fleet.balance(fleet.owner_ids[0]).balance_nano_usd == 0


def test_an_empty_answer_costs_nothing(database_url, start_worker, fleet_of):
    worker = start_worker(stop_after_tokens=0)
    fleet = fleet_of(worker.url)
    before = {account: fleet.balance(account) for account in (fleet.customer_id, *fleet.owner_ids)}
    with serving(database_url) as proxy:
        client = _client(fleet, proxy)
        raw = client.responses.with_raw_response.create(model=MODEL, input="Say nothing.", max_output_tokens=20)
        events = list(client.responses.create(model=MODEL, input="Say nothing.", max_output_tokens=20, stream=True))
    answer = raw.parse()
    assert answer.output == [] and answer.usage.output_tokens == 0 and raw.headers["x-paralon-cost-nano-usd"] == "0"
    assert events[-1].type == "response.completed" and events[-1].response.usage.model_extra["cost_details"]["nano_usd"] == 0
    assert {account: fleet.balance(account) for account in before} == before, "nothing moved"
    assert fleet.settlements() == []


def test_a_worker_dying_mid_stream_bills_only_the_streaming_caller_what_it_received(database_url, start_worker, fleet_of):
    worker = start_worker(fail_after_tokens=5)
    fleet = fleet_of(worker.url)
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    with serving(database_url) as proxy:
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 50, "stream": True}
        events = _events(httpx.post(proxy.url + "/v1/responses", json=body, headers=_headers(fleet), timeout=30))
        whole = httpx.post(proxy.url + "/v1/responses", json={**body, "stream": False}, headers=_headers(fleet), timeout=30)
    assert events[-1]["type"] == "error", "the caller is told the stream failed"
    assert sum(e["type"] == "response.output_text.delta" for e in events) == 5
    assert whole.status_code == 502
    [settled] = _assert_paid(fleet, before)
    assert settled["request_id"] == events[0]["response"]["id"] and settled["meta"]["completion_tokens"] == 5


def test_output_past_max_output_tokens_is_never_relayed_nor_billed(database_url, start_worker, fleet_of):
    worker = start_worker(extra_tokens=20)
    fleet = fleet_of(worker.url)
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    with serving(database_url) as proxy:
        events = list(_client(fleet, proxy).responses.create(model=MODEL, input="Hi", max_output_tokens=5, stream=True))
    assert sum(e.type == "response.output_text.delta" for e in events) == 5
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 5
    [settled] = _assert_paid(fleet, before)
    assert settled["meta"]["completion_tokens"] == 5


REFUSED = [
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
    {"input": "Hi", "tools": [{"type": "web_search"}]},
    {"input": 42},
    {"input": "Hi", "stream": "yes"},
    {"input": "Hi", "background": True},
]


def test_what_cannot_be_bounded_is_refused_before_anything_is_held(database_url, start_worker, fleet_of):
    worker = start_worker()
    fleet = fleet_of(worker.url)
    before = fleet.balance(fleet.customer_id)
    with serving(database_url) as proxy:
        refused = [httpx.post(proxy.url + "/v1/responses", json={"model": MODEL, **body}, headers=_headers(fleet))
                   for body in REFUSED]
    assert [r.status_code for r in refused] == [400] * len(REFUSED)
    assert all(r.json()["error"]["param"] for r in refused)
    assert fleet.balance(fleet.customer_id) == before and worker.app.state.requests_started == 0


def _generation(max_tokens: int = 100) -> ResponsesGeneration:
    request = read_request({"model": MODEL, "input": "Hi", "tools": TOOLS}, [])
    generation = ResponsesGeneration(
        kind=RESPONSES, request_id="resp_mine", model=MODEL, price=Price(INPUT_NANO_USD, OUTPUT_NANO_USD), grant=None,
        prompt_bound=request.prompt_bound, max_tokens=max_tokens, wants_usage=True, wants_continuous_usage=False,
        started_at=utc_now(), streaming=True, settle=None, request=request)
    generation.use_worker(None, {"tools": TOOLS})
    return generation


def _relay(generation: ResponsesGeneration, *events: dict) -> list[dict]:
    relayed = []
    for event in events:
        out = generation.transform(orjson.dumps(event))
        relayed += [orjson.loads(line[6:]) for line in (out or b"").decode().splitlines() if line.startswith("data: ")]
    return relayed


def test_the_caller_gets_what_was_relayed_whatever_the_worker_claims_in_its_done_events():
    """Text smuggled into added items, parts and `.done` events is replaced by
    the deltas relayed (the only text counted); reasoning, vLLM's
    reasoning_part events and a function call's name are counted."""
    generation = _generation()
    relayed = _relay(
        generation,
        {"type": "response.created", "response": {"id": "theirs", "model": "x", "output": [{"type": "message"}]}},
        {"type": "response.output_item.added", "output_index": 0, "item": {"type": "reasoning", "id": "rs_1", "summary": [
            {"type": "summary_text", "text": "smuggled"}]}},
        {"type": "response.reasoning_part.added", "output_index": 0, "item_id": "rs_1", "content_index": 0,
         "part": {"type": "reasoning_text", "text": "smuggled"}},
        {"type": "response.reasoning_text.delta", "output_index": 0, "item_id": "rs_1", "content_index": 0, "delta": "hmm"},
        {"type": "response.reasoning_text.done", "output_index": 0, "item_id": "rs_1", "content_index": 0, "text": "smuggled"},
        {"type": "response.output_item.done", "output_index": 0, "item": {"type": "reasoning", "id": "rs_1", "summary": []}},
        {"type": "response.output_item.added", "output_index": 1, "item": {
            "type": "message", "id": "msg_1", "content": [{"type": "output_text", "text": "smuggled"}]}},
        {"type": "response.content_part.added", "output_index": 1, "item_id": "msg_1", "content_index": 0,
         "part": {"type": "output_text", "text": "smuggled"}},
        {"type": "response.output_text.delta", "output_index": 1, "item_id": "msg_1", "content_index": 0, "delta": "Hello"},
        {"type": "response.output_text.done", "output_index": 1, "item_id": "msg_1", "content_index": 0, "text": "smuggled"},
        {"type": "response.output_text.delta", "output_index": 7, "item_id": "msg_1", "content_index": 0, "delta": "nope"},
        {"type": "response.output_item.added", "output_index": 2, "item": {
            "type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup", "arguments": "smuggled"}},
        {"type": "response.function_call_arguments.delta", "output_index": 2, "item_id": "fc_1", "delta": "{}"},
        {"type": "response.function_call_arguments.done", "output_index": 2, "item_id": "fc_1", "arguments": "smuggled"},
        {"type": "response.some_future_event", "text": "smuggled"},
        {"type": "response.completed", "response": {"status": "completed", "usage": {"input_tokens": 3, "output_tokens": 9}}},
    )
    assert b"smuggled" not in orjson.dumps(relayed)
    assert [e["sequence_number"] for e in relayed] == list(range(len(relayed)))
    assert relayed[0]["response"]["id"] == "resp_mine" and relayed[0]["response"]["output"] == []
    assert {e["type"] for e in relayed} >= {"response.content_part.added", "response.reasoning_text.done"}
    assert [e.get("text") for e in relayed if e["type"].endswith("text.done")] == ["hmm", "Hello"]
    assert generation.output.relayed_bytes == len("hmm") + len("Hello") + len("lookup") + len("{}")
    assert generation.output.dropped == 1, "the delta of an item never added"
    assert generation.output.tool_call_indexes == {2} and generation.output.finished
    assert (generation.reported_prompt, generation.reported_completion) == (3, 9)


def test_nothing_is_relayed_past_what_the_hold_pays_for():
    generation = _generation(max_tokens=2)
    added = {"type": "response.output_item.added", "output_index": 0, "item": {"type": "message", "id": "m"}}
    part = {"type": "response.content_part.added", "output_index": 0, "content_index": 0, "part": {"type": "output_text"}}
    deltas = [{"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": f" w{i}"} for i in range(5)]
    relayed = _relay(generation, added, part, *deltas)
    assert [e["delta"] for e in relayed if e["type"] == "response.output_text.delta"] == [" w0", " w1"]
    assert generation.overran and generation.counted_tokens == 2
