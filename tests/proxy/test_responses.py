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
from ledger.service import append_now
from proxy import keys
from proxy.limits import COMPLETION_ALLOWANCE_TOKENS_PER_FINISH
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
    """The customer paid exactly the settled charges, nothing is held, owners got 80%."""
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
