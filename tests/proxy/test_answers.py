"""What callers get back through a real `paralon serve`, driven with the
official SDK against the agent worker (tests/support/agent_worker.py): whole
answers carry everything their stream carried (tool calls, reasoning, refusal,
logprobs), every choice of n > 1 and of prompt lists is relayed and billed,
usage.cost is a JSON number with its nine decimals, and max_completion_tokens
limits /v1/completions. Every test ends on exact balances."""
from __future__ import annotations

import json
import re

import httpx
import openai
import orjson
import pytest

from proxy import limits, metering
from proxy.errors import InvalidRequest
from proxy.generation import CHAT, Generation
from proxy.prices import Price
from tests.support.agent_worker import ANSWER_WORDS, REASONING_WORDS, REFUSAL_TEXT, start_agent_worker
from tests.support.harness import MODEL, make_fleet, serving

OWNER_SHARE_PERCENT = 80
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
COST_TEXT = re.compile(rb'"cost":(\d+\.\d{9})[,}]')


@pytest.fixture
def agent(postgres_url):
    """One agent worker, its fleet, and `paralon serve` in front: (fleet, worker app, proxy, client)."""
    server = start_agent_worker()
    try:
        fleet = make_fleet(postgres_url, [server.url])
        with serving(postgres_url) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
            yield fleet, server.app, proxy, client
    finally:
        server.stop()


def assert_exact_books(fleet, before_nano_usd: int) -> list[dict]:
    """The customer lost exactly the settled charges, the owner got exactly 80%
    of each, nothing is held (once the pools are released)."""
    fleet.pools_released()
    settled = fleet.settlements()
    customer = fleet.balance(fleet.customer_id)
    assert before_nano_usd - customer.balance_nano_usd == sum(s["charge_nano_usd"] for s in settled)
    assert customer.held_nano_usd == 0
    owner = fleet.balance(fleet.owner_ids[0]).balance_nano_usd
    assert owner == sum(s["charge_nano_usd"] * OWNER_SHARE_PERCENT // 100 for s in settled)
    fleet.assert_books_close()
    return settled


def chat(n: int = 1, content: str = "Where is home?", **options) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "n": n, **options}


def streamed_choices(client: openai.OpenAI, body: dict) -> tuple[dict, list]:
    """Per index, the deltas' parts joined, and the chunks as received."""
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            parts = choices.setdefault(choice.index, {"content": "", "reasoning": "", "refusal": "", "calls": {},
                                                      "logprobs": [], "finish_reason": None})
            delta = choice.delta
            parts["content"] += delta.content or ""
            parts["refusal"] += delta.refusal or ""
            parts["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or ():
                whole = parts["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                whole["id"] = call.id or whole["id"]
                whole["name"] += call.function.name or ""
                whole["arguments"] += call.function.arguments or ""
            if choice.logprobs is not None:
                parts["logprobs"] += choice.logprobs.content or []
            parts["finish_reason"] = choice.finish_reason or parts["finish_reason"]
    return choices, chunks


def test_tool_calls_reasoning_and_logprobs_come_back_whole_as_they_were_streamed(agent):
    """Given tools offered and a request to think, when the same question is
    asked without and with streaming, then the whole answer carries the tool
    call (content null), the reasoning, and equals what the stream carried."""
    fleet, worker, _, client = agent
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    body = chat(content="Weather at home? (think)", tools=[WEATHER_TOOL])
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments)["city"]
    assert message.reasoning_content and len(message.reasoning_content.split()) == REASONING_WORDS
    streamed, _ = streamed_choices(client, body)
    [parts] = streamed.values()
    assert parts["finish_reason"] == "tool_calls" and parts["content"] == ""
    assert [(c["name"], c["arguments"]) for c in parts["calls"].values()] == [(call.function.name, call.function.arguments)]
    assert parts["reasoning"] == message.reasoning_content
    settled = assert_exact_books(fleet, before)
    assert [s["meta"]["completion_tokens"] for s in settled] == [r.completion_tokens for r in worker.received]


def test_chat_logprobs_stream_and_whole(agent):
    fleet, _, _, client = agent
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    body = chat(logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**body)
    entries = whole.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == whole.choices[0].message.content
    assert len(entries) == ANSWER_WORDS and all(len(e.top_logprobs) == 3 and e.bytes == list(e.token.encode())
                                                 for e in entries)
    streamed, _ = streamed_choices(client, body)
    assert [e.model_dump() for e in streamed[0]["logprobs"]] == [e.model_dump() for e in entries]
    settled = assert_exact_books(fleet, before)
    # Logprobs repeat the tokens: billed as the text alone.
    assert [s["meta"]["completion_tokens"] for s in settled] == [ANSWER_WORDS, ANSWER_WORDS]


def test_completion_logprobs_stream_and_whole(agent):
    fleet, _, _, client = agent
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", logprobs=2, max_tokens=5)
    logprobs = whole.choices[0].logprobs
    assert "".join(logprobs.tokens) == whole.choices[0].text and len(logprobs.tokens) == 5
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == 5
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    tokens, offsets = [], []
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", logprobs=2, max_tokens=5, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
    assert tokens == logprobs.tokens and offsets == logprobs.text_offset
    assert_exact_books(fleet, before)


def test_a_refusal_comes_back_as_refusal_with_null_content(agent):
    fleet, _, _, client = agent
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    message = client.chat.completions.create(**chat(content="Do something bad (refuse)")).choices[0].message
    assert message.content is None and message.refusal == REFUSAL_TEXT
    streamed, _ = streamed_choices(client, chat(content="Do something bad (refuse)"))
    assert streamed[0]["refusal"] == REFUSAL_TEXT
    settled = assert_exact_books(fleet, before)
    assert all(s["meta"]["completion_tokens"] == len(REFUSAL_TEXT.split()) for s in settled)


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_n_choices_are_all_relayed_and_all_billed(agent, streaming):
    """Given n=3, then every index 0..2 arrives, each with its own text and
    finish_reason, and the charge covers the three choices exactly."""
    fleet, worker, _, client = agent
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    if streaming:
        choices, chunks = streamed_choices(client, chat(n=3))
        assert sorted(choices) == [0, 1, 2]
        texts = [choices[i]["content"] for i in range(3)]
        finishes = [choices[i]["finish_reason"] for i in range(3)]
        usage = chunks[-1].usage
    else:
        answer = client.chat.completions.create(**chat(n=3))
        assert [c.index for c in answer.choices] == [0, 1, 2]
        texts = [c.message.content for c in answer.choices]
        finishes = [c.finish_reason for c in answer.choices]
        usage = answer.usage
    assert len(set(texts)) == 3 and all(len(t.split()) == ANSWER_WORDS for t in texts)
    assert finishes == ["stop"] * 3
    [record] = worker.received
    assert record.body["n"] == 3
    assert usage.completion_tokens == 3 * ANSWER_WORDS == record.completion_tokens
    assert usage.prompt_tokens == record.prompt_tokens  # the prompt once, whatever n
    [settled] = assert_exact_books(fleet, before)
    assert settled["meta"]["completion_tokens"] == 3 * ANSWER_WORDS
    assert settled["charge_nano_usd"] == 150 * record.prompt_tokens + 600 * 3 * ANSWER_WORDS


def test_a_list_of_two_prompts_with_n_2_gives_four_choices(agent):
    fleet, worker, _, client = agent
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    answer = client.completions.create(model=MODEL, prompt=["The first prompt", "The second one"], n=2, max_tokens=4)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert all(len(c.text.split()) == 4 and c.finish_reason == "length" for c in answer.choices)
    stream = client.completions.create(model=MODEL, prompt=["The first prompt", "The second one"], n=2, max_tokens=4,
                                       stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in answer.choices}
    settled = assert_exact_books(fleet, before)
    assert [s["meta"]["completion_tokens"] for s in settled] == [16, 16]
    assert [s["meta"]["prompt_tokens"] for s in settled] == [r.prompt_tokens for r in worker.received]
    assert worker.received[0].prompt_tokens == len("The first prompt") // 4 + 3


def test_n_above_the_limit_is_refused_and_nothing_moves(agent):
    fleet, worker, _, client = agent
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**chat(n=limits.CHOICES_PER_PROMPT_MAX + 1))
    assert refused.value.body["param"] == "n"
    assert fleet.balance(fleet.customer_id).balance_nano_usd == before and not worker.received


@pytest.mark.parametrize("attack", ["out_of_range_choice", "duplicate_choices"])
def test_a_worker_sending_stray_or_duplicate_choices_is_billed_at_most_what_was_relayed(postgres_url, attack):
    """Given a worker that adds a choice index the request never asked for,
    or sends every choice twice in a chunk, then the caller never sees it,
    the bill counts only what was relayed, and the stream is evidence against
    the worker."""
    server = start_agent_worker(**{attack: True})
    try:
        fleet = make_fleet(postgres_url, [server.url])
        before = fleet.balance(fleet.customer_id).balance_nano_usd
        with serving(postgres_url) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
            choices, chunks = streamed_choices(client, chat(n=2))
    finally:
        server.stop()
    assert sorted(choices) == [0, 1]
    assert all(len({c.index for c in chunk.choices}) == len(chunk.choices) for chunk in chunks)
    assert all(len(choices[i]["content"].split()) == ANSWER_WORDS for i in range(2))
    [settled] = assert_exact_books(fleet, before)
    relayed_bytes = sum(len(choices[i]["content"].encode()) for i in range(2))
    [record] = server.app.received
    assert settled["meta"]["completion_tokens"] <= relayed_bytes + 2 * limits.COMPLETION_ALLOWANCE_TOKENS_PER_FINISH
    assert settled["meta"]["completion_tokens"] <= record.completion_tokens * 2 + 1  # never above the report
    assert fleet.events("UsageDiscrepancyRecorded") == 1  # the dropped choices are evidence


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_usage_cost_is_a_json_number_with_nine_decimals(agent, streaming):
    fleet, _, proxy, _ = agent
    body = {**chat(), "stream": streaming, "stream_options": {"include_usage": True}}
    response = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30,
                          headers={"authorization": f"Bearer {fleet.key}"})
    assert response.status_code == 200
    [cost_text] = COST_TEXT.findall(response.content)
    usage = [orjson.loads(line[len(b"data: "):]) for line in response.content.split(b"\n\n")
             if line.startswith(b"data: {")][-1]["usage"] if streaming else response.json()["usage"]
    nano_usd = usage["cost_details"]["nano_usd"]
    assert type(usage["cost"]) is float and type(nano_usd) is int and nano_usd > 0
    whole, fraction = cost_text.split(b".")
    assert int(whole) * 10**9 + int(fraction) == nano_usd  # the text is exact; no float was involved
    [settled] = fleet.settlements()
    assert settled["charge_nano_usd"] == nano_usd
    if not streaming:
        assert response.headers["x-paralon-cost-nano-usd"] == str(nano_usd)


def test_max_completion_tokens_limits_a_completion(agent):
    fleet, worker, _, client = agent
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    answer = client.completions.create(model=MODEL, prompt="Count", extra_body={"max_completion_tokens": 3})
    assert len(answer.choices[0].text.split()) == 3 and answer.choices[0].finish_reason == "length"
    assert worker.received[0].body["max_tokens"] == 3
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Count", extra_body={"max_completion_tokens": 0})
    assert refused.value.body["param"] == "max_completion_tokens"
    [settled] = assert_exact_books(fleet, before)
    assert settled["meta"]["completion_tokens"] == 3


# --- the rules, without a server ----------------------------------------------

PRICE = Price(150, 600)


def _generation(choices: int, n: int, max_tokens: int) -> Generation:
    generation = Generation(kind=CHAT, request_id="chatcmpl-test", model=MODEL, price=PRICE, grant=None, prompt_bound=50,
                            max_tokens=max_tokens, wants_usage=False, wants_continuous_usage=False, started_at=None,
                            streaming=True, settle=None, choices_per_prompt=n, choices=choices)
    generation.use_worker(None, {})
    return generation


def _token(index: int, text: str = " word") -> bytes:
    return orjson.dumps({"choices": [{"index": index, "delta": {"content": text}, "finish_reason": None}]})


def test_the_hold_pays_for_max_tokens_of_every_choice():
    plan = metering.plan_hold(PRICE, 50, 100, choices=6)
    assert plan == (50 * 150 + 6 * 100 * 600, 50 * 150 + 6 * 600)
    assert metering.affordable_max_tokens(PRICE, 50, plan.amount_nano_usd, choices=6) == 100
    assert metering.requested_choices("completions", {"prompt": ["a", [1, 2]], "n": 3}) == 6
    assert metering.prompt_tokens_bound("completions", {"prompt": ["ab", [1, 2]]}) == (
        limits.TEMPLATE_TOKENS_PER_REQUEST + 2 + limits.TEMPLATE_TOKENS_WITH_TOKEN_IDS + 2)
    for bad in (0, -1, True, 1.0, "2", limits.CHOICES_PER_PROMPT_MAX + 1):
        with pytest.raises(InvalidRequest) as refused:
            metering.requested_choices("chat", {"n": bad})
        assert refused.value.param == "n"


def test_max_tokens_holds_per_choice_and_the_bill_is_the_sum_over_choices():
    generation = _generation(choices=2, n=2, max_tokens=3)
    relayed = [generation.transform(_token(i % 2)) for i in range(10)]
    assert sum(event is not None for event in relayed) == 6 and generation.overran
    generation.reported_completion, generation.reported_prompt = 6, 10
    assert generation.delivered_usage().completion_tokens == 6  # three per choice, both billed


def test_out_of_range_duplicate_and_malformed_choices_are_dropped_and_counted():
    generation = _generation(choices=2, n=2, max_tokens=100)
    chunk = {"choices": [{"index": 0, "delta": {"content": " a"}}, {"index": 0, "delta": {"content": " b"}},
                         {"index": 2, "delta": {"content": " c"}}, {"index": "1", "delta": {"content": " d"}},
                         {"index": 1, "delta": {"content": " e"}, "logprobs": "junk"}]}
    event = generation.transform(orjson.dumps(chunk))
    assert [c["delta"]["content"] for c in orjson.loads(event[6:])["choices"]] == [" a"]
    assert generation.output.dropped == 4 and generation.output.relayed_bytes == 2
    assert generation.transform(_token(2)) is None and generation.output.dropped == 5


def test_choices_a_worker_never_sent_earn_no_allowance():
    """A worker that ignores n sends one choice and [DONE]: the others were
    never received, so they add nothing to what may be billed."""
    asked_three = metering.ChoiceOutputs.of(3, stop_bytes=10)
    sent = asked_three.choices[0]
    sent.relayed_chunks, sent.relayed_bytes = 4, 20
    asked_three.finish_all()
    alone = metering.OutputCount(relayed_bytes=20, relayed_chunks=4, finished=True, stop_bytes=10)
    assert asked_three.completion_bound() == alone.completion_bound()
