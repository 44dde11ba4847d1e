"""The proxy's own count of a request (DESIGN.md, Metering rules): the rules
on their own, then through a real `paralon serve` on PostgreSQL in front of
hand-written workers that split, pad and duplicate what they send."""
from __future__ import annotations

import httpx
import orjson
import pytest
from sqlalchemy import select

from ledger import commands as cmd
from ledger.schema import accounts
from proxy import limits, metering
from proxy.errors import InvalidRequest, UpstreamFailed
from proxy.forwarded_fields import FORWARDED_FIELDS, upstream_fields
from proxy.generation import CHAT, COMPLETIONS, Generation
from proxy.prices import Price
from proxy.sim.requests import chat_prompt, count_prompt_tokens
from tests.support.hand_written_worker import HandWrittenWorker
from tests.support.harness import MODEL, ThreadedServer, make_fleet, serving, sim_worker

PRICE = Price(150, 600)  # what make_fleet sets: $0.15 and $0.60 per million tokens
CREDITS_NANO_USD = 10 * 10**9
# limits.COMPLETION_ALLOWANCE_TOKENS_PER_FINISH, written out so that these
# tests state the rule rather than read it from the code under test.
FINISH_ALLOWANCE_TOKENS = 8
WORDS = [f" w{i:02d}" for i in range(20)]  # 20 words, 4 bytes each as the caller receives them
SET_BY_THE_PROXY = {"model", "stream", "stream_options", "max_tokens"}


# --- the rules ---------------------------------------------------------------


def _generation(kind: str = CHAT, max_tokens: int = 1000, prompt_bound: int = 50, **body) -> Generation:
    generation = Generation(kind=kind, request_id="chatcmpl-test", model=MODEL, price=PRICE, grant=None,
                            prompt_bound=prompt_bound, max_tokens=max_tokens, wants_usage=False,
                            wants_continuous_usage=False, started_at=None, streaming=True, settle=None)
    generation.use_worker(None, body)
    return generation


class _Written:
    """A caller's writer that never backs up, keeping what it is given."""

    backed_up = gone = False

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, chunks: list[bytes]) -> None:
        self.chunks += chunks


@pytest.mark.parametrize("event", [b"[1, 2]", b'"text"', b"3", b"null", b"{not json"])
def test_an_event_that_is_not_a_json_object_ends_the_relay_as_the_workers_failure_after_what_was_relayed(event):
    """Read in the socket's callback, it must not raise there: the relay stops
    reading, keeps the failure for the relay's task, and what came before it in
    the same piece stays relayed (and counted)."""
    generation = _generation()
    generation.writer = written = _Written()
    good = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": " hi"}, "finish_reason": None}]}) + b"\n\n"
    assert generation.take_piece(good) is True
    assert generation.take_piece(good + b"data: " + event + b"\n\n" + good) is False
    assert generation.reading_over and isinstance(generation.relay_error, (UpstreamFailed, ValueError))
    assert len(written.chunks) == 2 and generation.counted_tokens == 2, "the event after the bad one is not relayed"


def test_what_arrives_after_the_caller_left_is_neither_written_nor_counted():
    """Between the caller's connection lost and its relay cancelled, the
    worker's tokens still arrive: the caller did not receive them, so they
    are not billed."""
    generation = _generation()
    generation.writer = written = _Written()
    piece = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": " hi"}, "finish_reason": None}]}) + b"\n\n"
    assert generation.take_piece(piece) is True
    written.gone = True
    assert generation.take_piece(piece) is False
    assert len(written.chunks) == 1 and generation.counted_tokens == 1


def _tools(*names: str) -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in names]


def _relay(generation: Generation, *chunks: dict) -> list[dict]:
    relayed = [generation.transform(orjson.dumps(chunk)) for chunk in chunks]
    return [orjson.loads(event[6:]) for event in relayed if event is not None]


def _delta(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _usage(prompt: int, completion: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


FINISH = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}


def test_the_finish_allowance_is_the_documented_one():
    assert limits.COMPLETION_ALLOWANCE_TOKENS_PER_FINISH == FINISH_ALLOWANCE_TOKENS


def test_an_honest_stream_is_billed_as_reported():
    generation = _generation()
    _relay(generation, *(_delta(content=w) for w in WORDS), FINISH, _usage(12, 21))
    assert generation.output.relayed_bytes == 80 and generation.counted_tokens == 20
    assert generation.delivered_usage() == (12, 21, False, None)


@pytest.mark.parametrize("padding", [
    {"tool_calls": [{}]},  # an empty tool-call entry relays no name and no arguments
    {"content": ""},
    {"role": "assistant"},
])
def test_chunks_that_relay_nothing_do_not_raise_the_bound(padding):
    generation = _generation()
    chunks = [c for w in WORDS for c in (_delta(content=w), *[_delta(**padding)] * 9)]
    _relay(generation, *chunks, FINISH, _usage(12, 200))
    assert generation.output.completion_bound() == 80 + FINISH_ALLOWANCE_TOKENS
    billed = generation.delivered_usage()
    assert billed == (12, 88, True, metering.STRIKE_COMPLETION_ABOVE_BOUND)


def test_whitespace_counts_as_the_bytes_it_is():
    generation = _generation()
    chunks = [c for w in WORDS for c in (_delta(content=w), *[_delta(reasoning_content=" ")] * 9)]
    _relay(generation, *chunks, FINISH, _usage(12, 1000))
    assert generation.output.relayed_bytes == 80 + 180
    assert generation.delivered_usage() == (12, 268, True, metering.STRIKE_COMPLETION_ABOVE_BOUND)


def test_splitting_the_same_text_never_raises_the_bound():
    text = "".join(WORDS)
    whole, split = _generation(), _generation()
    _relay(whole, _delta(content=text), FINISH)
    _relay(split, *(_delta(content=ch) for ch in text), FINISH)
    assert whole.output.completion_bound() == split.output.completion_bound() == len(text) + FINISH_ALLOWANCE_TOKENS


def test_reasoning_sent_under_both_names_counts_once():
    generation = _generation()
    _relay(generation, _delta(reasoning_content="think", reasoning="think"), _delta(reasoning="more"))
    assert generation.output.relayed_bytes == 5 + 4


def test_duplicate_choices_are_dropped_and_are_evidence():
    generation = _generation()
    duplicated = [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}] * 10} for w in WORDS]
    relayed = _relay(generation, *duplicated, FINISH, _usage(12, 200))
    assert all(len(chunk["choices"]) == 1 for chunk in relayed), "the caller gets one choice per chunk"
    assert generation.output.dropped == 20 * 9
    assert generation.delivered_usage() == (12, 88, True, metering.STRIKE_COMPLETION_ABOVE_BOUND)


@pytest.mark.parametrize("bad_choice", ["text", 7, None, {"index": 1, "delta": {"content": " x"}},
                                        {"index": 0, "delta": {"content": 123}}, {"index": 0, "delta": "x"}])
def test_malformed_choices_are_dropped_and_are_evidence_even_with_an_honest_report(bad_choice):
    generation = _generation()
    relayed = _relay(generation, _delta(content=" hi"), {"choices": [bad_choice]}, FINISH, _usage(12, 2))
    assert [c["choices"][0]["delta"] for c in relayed] == [{"content": " hi"}, {}]
    assert generation.delivered_usage() == (12, 2, True, metering.STRIKE_MALFORMED_CHOICES)


def test_tool_call_entries_that_are_not_objects_are_dropped():
    generation = _generation(tools=_tools("get_time"))
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    relayed = _relay(generation, _delta(tool_calls=[call, "junk", 3]), FINISH)
    assert relayed[0]["choices"][0]["delta"]["tool_calls"] == [call]
    assert generation.output.relayed_bytes == len("get_time{}") and generation.output.dropped == 2
    assert generation.output.completion_bound() == (len("get_time{}") + FINISH_ALLOWANCE_TOKENS
                                                    + limits.COMPLETION_ALLOWANCE_TOKENS_PER_TOOL_CALL)


def test_a_tool_call_gets_its_markup_allowance_once_however_often_its_name_is_repeated():
    generation = _generation(tools=_tools("f"))
    named = {"index": 0, "function": {"name": "f"}}
    _relay(generation, *[_delta(tool_calls=[named])] * 10, FINISH)
    assert generation.output.completion_bound() == 10 + FINISH_ALLOWANCE_TOKENS + limits.COMPLETION_ALLOWANCE_TOKENS_PER_TOOL_CALL


def test_a_thousand_tool_calls_in_one_chunk_are_billed_their_bytes_and_struck():
    """No tools offered: no markup allowance, and calls beyond the most an answer may hold are dropped."""
    generation = _generation()
    calls = [{"index": i, "function": {"name": "a"}} for i in range(1000)]
    [relayed, _] = _relay(generation, _delta(tool_calls=calls), FINISH, _usage(12, 25_000))
    assert relayed["choices"][0]["delta"]["tool_calls"] == calls[:limits.TOOL_CALLS_PER_ANSWER_MAX]
    assert generation.output.dropped == 1000 - limits.TOOL_CALLS_PER_ANSWER_MAX
    received_bytes = limits.TOOL_CALLS_PER_ANSWER_MAX * len("a")
    assert generation.delivered_usage() == (12, received_bytes + FINISH_ALLOWANCE_TOKENS, True,
                                            metering.STRIKE_COMPLETION_ABOVE_BOUND)


def test_offered_tools_get_the_markup_allowance_for_at_most_the_calls_an_answer_may_hold():
    generation = _generation(tools=_tools("a"))
    _relay(generation, _delta(tool_calls=[{"index": i, "function": {"name": "a"}} for i in range(1000)]), FINISH)
    most = limits.TOOL_CALLS_PER_ANSWER_MAX
    assert generation.output.completion_bound() == (most + FINISH_ALLOWANCE_TOKENS
                                                    + most * limits.COMPLETION_ALLOWANCE_TOKENS_PER_TOOL_CALL)


def test_a_tool_call_that_skips_an_index_is_dropped_and_is_evidence():
    generation = _generation(tools=_tools("f"))
    first, skipping = {"index": 0, "function": {"name": "f"}}, {"index": 2, "function": {"name": "f"}}
    relayed = _relay(generation, _delta(tool_calls=[first]), _delta(tool_calls=[skipping]), FINISH, _usage(12, 1))
    assert [c["choices"][0]["delta"].get("tool_calls") for c in relayed] == [[first], [], None]
    assert generation.output.tool_call_indexes == {0} and generation.output.dropped == 1
    assert generation.delivered_usage() == (12, 1, True, metering.STRIKE_MALFORMED_CHOICES)


def test_three_parallel_calls_of_offered_functions_are_billed_as_reported():
    generation = _generation(tools=_tools("get_weather", "get_time"), parallel_tool_calls=True)
    chunks = []
    for i, (name, arguments) in enumerate([("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}'),
                                           ("get_weather", '{"city": "Oslo"}')]):
        chunks.append(_delta(tool_calls=[{"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name}}]))
        chunks.append(_delta(tool_calls=[{"index": i, "function": {"arguments": arguments}}]))
    relayed_bytes = len("get_weather" '{"city": "Paris"}' "get_time" '{"tz": "CET"}' "get_weather" '{"city": "Oslo"}')
    # An engine's count: the markup around each call and the stop token, within the allowances.
    honest = relayed_bytes // 3 + 3 * limits.COMPLETION_ALLOWANCE_TOKENS_PER_TOOL_CALL + 2
    _relay(generation, *chunks, FINISH, _usage(40, honest))
    assert generation.output.relayed_bytes == relayed_bytes and generation.output.tool_call_indexes == {0, 1, 2}
    assert generation.delivered_usage() == (40, honest, False, None)


def test_a_tool_name_that_was_not_offered_is_relayed_without_the_allowance_and_without_a_strike():
    """Models hallucinate names: an honest worker relays them, and is not struck for them."""
    generation = _generation(tools=_tools("get_weather"))
    call = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_wether", "arguments": "{}"}}
    [relayed, _] = _relay(generation, _delta(tool_calls=[call]), FINISH, _usage(12, 5))
    assert relayed["choices"][0]["delta"]["tool_calls"] == [call]
    assert generation.output.completion_bound() == len("get_wether{}") + FINISH_ALLOWANCE_TOKENS
    assert generation.delivered_usage() == (12, 5, False, None)


def test_a_stop_string_held_back_when_the_caller_leaves_is_allowed_and_no_strike():
    """vLLM holds back up to len(stop) - 1 characters while they may still
    match, and counts them: a caller with a 4 KB stop string that leaves
    mid-stream must not make an honest report exceed the bound."""
    stop = "x" * 4096
    generation = _generation(max_tokens=10_000, stop=[stop])
    _relay(generation, *(_delta(content=w) for w in WORDS), _usage(12, 20 + len(stop) - 1))
    assert not generation.output.finished
    assert generation.delivered_usage() == (12, 20 + len(stop) - 1, False, None)


@pytest.mark.parametrize("finished, strike_reason", [(False, None), (True, metering.STRIKE_COMPLETION_ABOVE_BOUND)])
def test_a_report_above_the_bound_is_proof_only_when_the_answer_finished(finished, strike_reason):
    """A caller that leaves, a worker that fails or max_tokens cuts the answer:
    what the engine holds back is not proof against it. Billed at the bound either way."""
    generation = _generation()
    _relay(generation, *(_delta(content=w) for w in WORDS), *([FINISH] if finished else []), _usage(12, 500))
    bound = 80 + (FINISH_ALLOWANCE_TOKENS if finished else 0)
    assert generation.delivered_usage() == (12, bound, True, strike_reason)


def test_the_finish_allowance_is_given_once():
    generation = _generation()
    _relay(generation, _delta(content=" a"), *[FINISH] * 10)
    assert generation.output.completion_bound() == 2 + FINISH_ALLOWANCE_TOKENS


def test_a_stop_string_is_allowed_for_it_is_generated_but_not_relayed():
    generation = _generation(stop=["\nUser:", "END"])
    _relay(generation, _delta(content=" a"), FINISH, _usage(5, 2 + FINISH_ALLOWANCE_TOKENS + 6))
    assert generation.delivered_usage() == (5, 2 + FINISH_ALLOWANCE_TOKENS + 6, False, None)


def test_max_tokens_still_stops_the_relay():
    generation = _generation(max_tokens=5)
    relayed = _relay(generation, *(_delta(content=w) for w in WORDS))
    assert len(relayed) == 5 and generation.overran
    assert generation.delivered_usage().completion_tokens == 5


def test_delivered_usage_follows_the_latest_continuous_report():
    generation = _generation(max_tokens=100)
    for i, word in enumerate(WORDS[:10], 1):
        _relay(generation, {**_delta(content=word), "usage": {"prompt_tokens": 9, "completion_tokens": i}})
        assert generation.delivered_usage() == (9, i, False, None)


def test_a_completion_report_is_read_as_text():
    generation = _generation(kind=COMPLETIONS)
    _relay(generation, *({"choices": [{"index": 0, "text": w, "finish_reason": None}]} for w in WORDS), _usage(7, 20))
    assert generation.output.relayed_bytes == 80 and generation.delivered_usage() == (7, 20, False, None)


@pytest.mark.parametrize("usage", [{"prompt_tokens": "9", "completion_tokens": -3}, {"prompt_tokens": None}, [1, 2]])
def test_a_report_that_is_not_a_count_is_no_report(usage):
    generation = _generation(prompt_bound=40)
    _relay(generation, *(_delta(content=w) for w in WORDS[:3]), {"choices": [], "usage": usage})
    assert generation.delivered_usage() == (40, 3, False, None), "the bound and the chunks relayed"


@pytest.mark.parametrize(
    "reported, bound, relayed, billed",
    [
        ((40, 100), 50, 200, (40, 100, False, None)),  # honest
        ((40, 215), 50, 200, (40, 208, False, None)),  # within the tolerance above the bound: billed at it, no evidence
        ((40, 300), 50, 200, (40, 208, True, metering.STRIKE_COMPLETION_ABOVE_BOUND)),
        ((90, 100), 50, 200, (50, 100, True, None)),  # prompt above its bound: a discrepancy, no proof
        ((None, None), 50, 200, (50, 7, False, None)),  # no report: the chunks relayed and the bound
    ],
)
def test_billable_usage_is_the_report_within_the_bounds(reported, bound, relayed, billed):
    output = metering.OutputCount(relayed_bytes=relayed, relayed_chunks=7, finished=True)
    assert tuple(metering.billable_usage(*reported, prompt_bound=bound, output=output)) == billed


# --- the prompt bound ----------------------------------------------------------


def _agent_history(arguments_bytes: int) -> list[dict]:
    arguments = orjson.dumps({"path": "notes.txt", "text": "x" * (arguments_bytes - 32)}).decode()
    return [
        {"role": "system", "content": "You edit files."},
        {"role": "user", "content": "Write the notes."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "write_file", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "Now summarise them."}]},
    ]


def test_the_prompt_bound_counts_tool_calls_and_their_arguments():
    history = _agent_history(3000)
    bound = metering.prompt_tokens_bound("chat", {"messages": history})
    arguments = history[2]["tool_calls"][0]["function"]["arguments"]
    assert bound >= len(arguments.encode()) + limits.TEMPLATE_TOKENS_PER_TOOL_CALL
    honest = count_prompt_tokens(chat_prompt(history)[0])
    assert honest <= bound


def test_the_prompt_bound_counts_what_a_template_renders_of_tools_and_schemas():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "q": {"type": "string", "description": "é" * 100}}}}}]
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    plain = metering.prompt_tokens_bound("chat", {"messages": [{"role": "user", "content": "hi"}]})
    with_tools = metering.prompt_tokens_bound("chat", {"messages": [{"role": "user", "content": "hi"}],
                                                       "tools": tools, "response_format": schema})
    assert with_tools - plain >= limits.TEMPLATE_TOKENS_WITH_TOOLS + len(orjson.dumps(tools)) + len(orjson.dumps(schema))


def test_the_completions_prompt_bound():
    assert metering.prompt_tokens_bound("completions", {"prompt": "abc"}) == limits.TEMPLATE_TOKENS_PER_REQUEST + 3
    # Token ids are not tokenised, but an engine may still put BOS (and EOS) around them.
    assert metering.prompt_tokens_bound("completions", {"prompt": [1, 2, 3]}) == 3 + limits.TEMPLATE_TOKENS_WITH_TOKEN_IDS
    assert limits.TEMPLATE_TOKENS_WITH_TOKEN_IDS >= 1


@pytest.mark.parametrize("key", metering.MESSAGE_STRING_KEYS)
def test_every_message_key_that_is_forwarded_is_counted(key):
    message = {"role": "assistant", "content": "x"}
    without = metering.prompt_tokens_bound("chat", {"messages": [message]})
    with_key = metering.prompt_tokens_bound("chat", {"messages": [{**message, key: "é" * 100}]})
    assert with_key - without >= 200
    assert upstream_fields({"messages": [{**message, key: "é" * 100}]})["messages"][0][key] == "é" * 100


def test_only_the_keys_the_prompt_bound_counts_are_forwarded_inside_messages():
    counted = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    ]
    padded = [
        {**counted[0], "thinking": "y" * 5000},
        {**counted[1], "content": [{**counted[1]["content"][0], "cache_control": {"type": "ephemeral"}, "x": "y" * 500}]},
        {**counted[2], "thinking": "y" * 5000, "tool_calls": [{**counted[2]["tool_calls"][0], "index": 0, "extra": "y",
                                                               "function": {**counted[2]["tool_calls"][0]["function"],
                                                                            "description": "y" * 500}}]},
        {**counted[3], "tool_call_id": {"not": "a string"}, "metadata": {"a": 1}},
    ]
    without_the_id = {key: value for key, value in counted[3].items() if key != "tool_call_id"}
    assert upstream_fields({"messages": padded, "foo": 1})["messages"] == [*counted[:3], without_the_id]
    assert metering.prompt_tokens_bound("chat", {"messages": padded}) >= metering.prompt_tokens_bound(
        "chat", {"messages": counted}) - len("call_1")


@pytest.mark.parametrize("bad, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "file"}]}]}, "messages[1].content"),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "tools"),
])
def test_prompts_that_cannot_be_bounded_are_refused_naming_the_param(bad, param):
    with pytest.raises(InvalidRequest) as refused:
        metering.prompt_tokens_bound("chat", bad)
    assert refused.value.param == param


def test_only_documented_fields_are_forwarded():
    assert not {"sim_tokens", "sim_fail_before_first_token", "sim_fail_after_tokens", "sim_extra_tokens",
                "sim_inflate_usage", "chat_template", "chat_template_kwargs", "echo", "suffix", "best_of",
                "logit_bias", "ignore_eos", "use_beam_search", "user", "documents", "add_generation_prompt"} & FORWARDED_FIELDS
    assert {"messages", "prompt", "tools", "response_format", "temperature", "top_k", "min_p", "repetition_penalty",
            "min_tokens", "guided_json", "structured_outputs", "n", "logprobs", "top_logprobs"} <= FORWARDED_FIELDS


# --- through `paralon serve` ---------------------------------------------------


def _stream(deltas: list[dict], prompt_tokens: int, completion_tokens: int):
    def chunks(body):
        for delta in deltas:
            yield {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": body["model"], **delta}
        yield {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": body["model"], **FINISH}
        yield {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
               **_usage(prompt_tokens, completion_tokens)}
    return chunks


def _hostile(attack: str) -> list[dict]:
    if attack == "ten_choices_per_chunk":
        return [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}] * 10} for w in WORDS]
    padding = {"empty_tool_calls": {"tool_calls": [{}]}, "whitespace_reasoning": {"reasoning_content": " "}}[attack]
    return [c for w in WORDS for c in (_delta(content=w), *[_delta(**padding)] * 9)]


def _platform_balance(fleet) -> int:
    with fleet.engine.connect() as conn:
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == cmd.PLATFORM_REVENUE_ACCOUNT)).scalar_one()
    return fleet.balance(platform).balance_nano_usd


def _assert_charged_once(fleet, prompt_tokens: int, completion_tokens: int) -> None:
    """Exact balances: customer, owner and platform, and the books close."""
    [settled] = fleet.settlements()
    assert (settled["meta"]["prompt_tokens"], settled["meta"]["completion_tokens"]) == (prompt_tokens, completion_tokens)
    charge = prompt_tokens * PRICE.input_nano_usd_per_token + completion_tokens * PRICE.output_nano_usd_per_token
    assert settled["charge_nano_usd"] == charge
    customer = fleet.balance(fleet.customer_id)
    assert (customer.balance_nano_usd, customer.held_nano_usd) == (CREDITS_NANO_USD - charge, 0)
    assert fleet.balance(fleet.owner_ids[0]).balance_nano_usd == charge * 80 // 100
    assert _platform_balance(fleet) == charge - charge * 80 // 100
    fleet.assert_books_close()


def _received(response: httpx.Response) -> tuple[list[dict], int]:
    """The caller's chunks, and an independent count of the output bytes in them."""
    chunks = [orjson.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    output_bytes = 0
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            delta = choice["delta"]
            output_bytes += len((delta.get("content") or "").encode()) + len((delta.get("reasoning_content") or "").encode())
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                output_bytes += len((function.get("name") or "").encode() + (function.get("arguments") or "").encode())
    return chunks, output_bytes


def _post(proxy, fleet, body: dict) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {fleet.key}"})


@pytest.mark.parametrize("attack, reported", [
    ("ten_choices_per_chunk", 200),
    ("empty_tool_calls", 200),
    ("whitespace_reasoning", 1000),  # the padding is relayed: only a report beyond it is caught
])
def test_a_worker_that_splits_pads_or_duplicates_is_billed_the_bytes_relayed_and_struck(postgres_url, attack, reported):
    worker = ThreadedServer(HandWrittenWorker(_stream(_hostile(attack), 12, reported))).start()
    fleet = make_fleet(postgres_url, [worker.url])
    try:
        with serving(postgres_url) as proxy:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Say 20 words."}], "max_tokens": 1000,
                    "stream": True}
            response = _post(proxy, fleet, body)
    finally:
        worker.stop()
    assert response.status_code == 200
    chunks, received_bytes = _received(response)
    assert all(len(c["choices"]) <= 1 for c in chunks), "one choice per chunk reaches the caller"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "".join(WORDS)
    bound = received_bytes + FINISH_ALLOWANCE_TOKENS
    assert bound < reported
    _assert_charged_once(fleet, 12, bound)
    assert fleet.worker(fleet.worker_ids[0]).usage_strikes == 1
    assert fleet.events("UsageDiscrepancyRecorded") == 1


def test_an_agent_history_is_billed_the_honest_prompt_count_without_a_discrepancy(postgres_url):
    """3,000 bytes of tool-call arguments: the simulated worker counts them as a
    template renders them, and so must the proxy's bound."""
    worker = sim_worker("instant")
    fleet = make_fleet(postgres_url, [worker.url])
    history = _agent_history(3000)
    honest_prompt = count_prompt_tokens(chat_prompt(history)[0])
    assert honest_prompt > 750
    try:
        with serving(postgres_url) as proxy:
            for _ in range(4):  # four were enough to suspend an honest worker
                response = _post(proxy, fleet, {"model": MODEL, "messages": history, "max_tokens": 5})
                assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == honest_prompt
    finally:
        worker.stop()
    assert fleet.events("UsageDiscrepancyRecorded") == 0
    assert fleet.worker(fleet.worker_ids[0]).usage_strikes == 0
    assert [(s["meta"]["prompt_tokens"], s["meta"]["completion_tokens"]) for s in fleet.settlements()] == [(honest_prompt, 5)] * 4
    fleet.assert_books_close()


def test_an_unknown_body_field_never_reaches_the_worker(postgres_url):
    recorder = HandWrittenWorker(_stream([_delta(content=w) for w in WORDS[:3]], 9, 3))
    worker = ThreadedServer(recorder).start()
    fleet = make_fleet(postgres_url, [worker.url])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True,
            "temperature": 0.5, "top_k": 40, "sim_inflate_usage": 100, "sim_fail_after_tokens": 1, "sim_extra_tokens": 50,
            "chat_template_kwargs": {"enable_thinking": True}, "chat_template": "{{ 'x' * 100000 }}", "echo": True,
            "logit_bias": {"1": 100}, "ignore_eos": True, "user": "someone", "whatever": [1, 2, 3]}
    try:
        with serving(postgres_url) as proxy:
            response = _post(proxy, fleet, body)
    finally:
        worker.stop()
    assert response.status_code == 200
    [received] = recorder.bodies
    assert set(received) == {"messages", "temperature", "top_k"} | SET_BY_THE_PROXY
    assert (received["temperature"], received["top_k"], received["messages"]) == (0.5, 40, body["messages"])
    _assert_charged_once(fleet, 9, 3)


def test_keys_inside_messages_that_the_bound_does_not_count_never_reach_the_worker(postgres_url):
    """A `thinking` key is rendered by gpt-oss-style templates: forwarded, it
    would put uncounted tokens in an honest worker's prompt report."""
    recorder = HandWrittenWorker(_stream([_delta(content=w) for w in WORDS[:3]], 9, 3))
    worker = ThreadedServer(recorder).start()
    fleet = make_fleet(postgres_url, [worker.url])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Time?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": None, "thinking": "t" * 4000, "tool_calls": [{**call, "index": 0, "x": "y" * 100}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00", "thinking": "t" * 4000},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "stream": True, "tools": _tools("get_time")}
    try:
        with serving(postgres_url) as proxy:
            response = _post(proxy, fleet, body)
    finally:
        worker.stop()
    assert response.status_code == 200
    [received] = recorder.bodies
    assert received["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Time?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    _assert_charged_once(fleet, 9, 3)


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_image_and_audio_parts_are_refused_with_nothing_held_or_charged(postgres_url, part):
    recorder = HandWrittenWorker(_stream([], 1, 0))
    worker = ThreadedServer(recorder).start()
    fleet = make_fleet(postgres_url, [worker.url])
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, part]}]}
    try:
        with serving(postgres_url) as proxy:
            response = _post(proxy, fleet, body)
    finally:
        worker.stop()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages[0].content"
    assert part["type"] in error["message"]
    assert recorder.bodies == [] and fleet.settlements() == []
    customer = fleet.balance(fleet.customer_id)
    assert (customer.balance_nano_usd, customer.held_nano_usd) == (CREDITS_NANO_USD, 0)
    fleet.assert_books_close()


def test_a_non_streaming_answer_carries_the_reasoning_and_tool_calls_it_is_billed_for(postgres_url):
    arguments = '{"city": "Paris"}'
    deltas = [_delta(role="assistant", content=""), _delta(reasoning_content="Weather"), _delta(reasoning_content=" needed."),
              _delta(tool_calls=[{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather"}}]),
              *(_delta(tool_calls=[{"index": 0, "function": {"arguments": arguments[i:i + 5]}}]) for i in range(0, 17, 5))]
    worker = ThreadedServer(HandWrittenWorker(_stream(deltas, 30, 20))).start()
    fleet = make_fleet(postgres_url, [worker.url])
    try:
        with serving(postgres_url) as proxy:
            response = _post(proxy, fleet, {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                                            "tools": [{"type": "function", "function": {"name": "get_weather"}}]})
    finally:
        worker.stop()
    assert response.status_code == 200
    message = response.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "refusal": None, "reasoning_content": "Weather needed.",
                       "tool_calls": [{"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": arguments}}]}
    _assert_charged_once(fleet, 30, 20)
    assert fleet.events("UsageDiscrepancyRecorded") == 0
