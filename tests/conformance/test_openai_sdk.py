"""The official `openai` SDK, unchanged, against `paralon serve`: sync, async,
streams, tools, structured output, the Responses API, embeddings, models and
errors. Any warning the SDK raises fails the test; every body and stream event
it received is checked against OpenAI's OpenAPI document (paralon.check())."""
from __future__ import annotations

import asyncio
import base64
import json
from decimal import Decimal

import openai
import pytest
from pydantic import BaseModel

from tests.conformance.conftest import CLIENT_WARNINGS_ARE_ERRORS
from tests.conformance.recording import usd_to_nano_usd_exact

pytestmark = CLIENT_WARNINGS_ARE_ERRORS

FLOAT32_BYTES = 4  # a base64 embedding is little-endian float32s
HELLO = [{"role": "user", "content": "Say something."}]
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the catalogue.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                       "required": ["query", "limit"]},
    },
}
ASK_FOR_A_TOOL = [{"role": "user", "content": "Find me three warm mats."}]


class Search(BaseModel):
    """What the tool call's arguments and the structured answers are parsed into."""

    query: str
    limit: int


# --- chat completions ---------------------------------------------------------


def test_chat_completion_sync(paralon):
    client = paralon.openai()
    raw = client.chat.completions.with_raw_response.create(model=paralon.model(), messages=HELLO, max_tokens=5)
    answer = raw.parse()
    assert answer.choices[0].message.content.strip()
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5
    assert raw.headers["x-request-id"] == answer.id
    assert usd_to_nano_usd_exact(answer.usage.model_extra["cost"]) == int(raw.headers["x-paralon-cost-nano-usd"])
    paralon.check()


def test_usage_cost_is_a_json_number_with_nine_decimals(paralon):
    client = paralon.openai()
    raw = client.chat.completions.with_raw_response.create(model=paralon.model(), messages=HELLO, max_tokens=5)
    usage = json.loads(raw.http_response.text, parse_float=Decimal)["usage"]
    assert isinstance(usage["cost"], Decimal), f"usage.cost is {type(usage['cost']).__name__}, not a JSON number"
    cost_text = raw.http_response.text.split('"cost":', 1)[1].split(",", 1)[0].split("}", 1)[0].strip()
    assert cost_text == f"0.{int(raw.headers['x-paralon-cost-nano-usd']):09d}", "exactly nine decimals"
    assert usage["cost_details"] == {"nano_usd": int(raw.headers["x-paralon-cost-nano-usd"])}
    paralon.check()


def test_chat_completion_stream_with_and_without_usage(paralon):
    client = paralon.openai()
    chunks = list(client.chat.completions.create(model=paralon.model(), messages=HELLO, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 4
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert usd_to_nano_usd_exact(chunks[-1].usage.model_extra["cost"]) > 0
    plain = list(client.chat.completions.create(model=paralon.model(), messages=HELLO, max_tokens=3, stream=True))
    assert all(c.usage is None for c in plain)
    paralon.check()


def test_chat_completion_stream_helper(paralon):
    client = paralon.openai()
    # The agent model stops on its own (the helper refuses an answer cut at max_tokens).
    with client.chat.completions.stream(model=paralon.model("agent"), messages=HELLO, max_tokens=64) as stream:
        pieces = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"
    assert pieces and "".join(pieces) == final.choices[0].message.content
    paralon.check()


def test_completions_sync_and_stream(paralon):
    client = paralon.openai()
    completion = client.completions.create(model=paralon.model(), prompt="Once upon a time", max_tokens=6)
    assert completion.usage.completion_tokens == 6 and completion.choices[0].text
    streamed = list(client.completions.create(model=paralon.model(), prompt="Once upon a time", max_tokens=3,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices).strip()
    assert streamed[-1].usage.completion_tokens == 3
    paralon.check()


def test_async_client_sync_and_streams_concurrently(paralon):
    async def main():
        async with paralon.async_openai() as client:
            async def one(i):
                stream = await client.chat.completions.create(
                    model=paralon.model(), messages=[{"role": "user", "content": f"question {i}"}], max_tokens=5,
                    stream=True, stream_options={"include_usage": True})
                return [c async for c in stream][-1].usage
            usages = await asyncio.gather(*(one(i) for i in range(8)))
            single = await client.chat.completions.create(model=paralon.model(), messages=HELLO, max_tokens=2)
            return usages, single

    usages, single = asyncio.run(main())
    assert all(u.completion_tokens == 5 for u in usages) and single.usage.completion_tokens == 2
    assert len(paralon.recorder.to("/v1/chat/completions")) == 9
    paralon.check()


# --- tools and structured output ------------------------------------------------


def test_tool_call_streaming(paralon):
    client = paralon.openai()
    stream = client.chat.completions.create(model=paralon.model("agent"), messages=ASK_FOR_A_TOOL, tools=[SEARCH_TOOL],
                                            stream=True, stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                whole = calls.setdefault(call.index, {"name": "", "arguments": ""})
                whole["name"] += call.function.name or ""
                whole["arguments"] += call.function.arguments or ""
    assert finish == "tool_calls" and calls[0]["name"] == "search"
    Search.model_validate_json(calls[0]["arguments"])
    paralon.check()


def test_tool_call_not_streaming(paralon):
    client = paralon.openai()
    answer = client.chat.completions.create(model=paralon.model("agent"), messages=ASK_FOR_A_TOOL, tools=[SEARCH_TOOL])
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls, f"no tool_calls in {message}"
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "search" and call.id
    Search.model_validate_json(call.function.arguments)
    paralon.check()


def test_tool_call_round_trip(paralon):
    """The assistant's tool call and the tool's reply sent back: a text answer."""
    client = paralon.openai()
    first = client.chat.completions.create(model=paralon.model("agent"), messages=ASK_FOR_A_TOOL, tools=[SEARCH_TOOL])
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK_FOR_A_TOOL, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"results": ["mat 1", "mat 2", "mat 3"]}'}]
    second = client.chat.completions.create(model=paralon.model("agent"), messages=history, tools=[SEARCH_TOOL])
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    paralon.check()


def test_structured_output_with_parse_and_a_tool(paralon):
    client = paralon.openai()
    answer = client.chat.completions.parse(model=paralon.model("agent"), messages=ASK_FOR_A_TOOL,
                                           tools=[openai.pydantic_function_tool(Search, name="search")])
    parsed = answer.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Search)
    paralon.check()


def test_structured_output_with_a_json_schema(paralon):
    client = paralon.openai()
    answer = client.chat.completions.parse(model=paralon.model("agent"), response_format=Search,
                                           messages=[{"role": "user", "content": "Three warm mats, as JSON."}])
    assert isinstance(answer.choices[0].message.parsed, Search)
    paralon.check()


def test_logprobs_and_reasoning(paralon):
    client = paralon.openai()
    answer = client.chat.completions.create(model=paralon.model("agent"), max_tokens=8, logprobs=True, top_logprobs=2,
                                            messages=[{"role": "user", "content": "(think) Say something."}])
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert choice.message.model_extra.get("reasoning_content") or choice.message.model_extra.get("reasoning")
    streamed = list(client.chat.completions.create(model=paralon.model("agent"), max_tokens=8, logprobs=True,
                                                   stream=True, messages=HELLO))
    assert any(c.choices and c.choices[0].logprobs for c in streamed)
    completion = client.completions.create(model=paralon.model("agent"), prompt="Once", max_tokens=4, logprobs=2)
    assert completion.choices[0].logprobs is not None and completion.choices[0].logprobs.tokens
    paralon.check()


def test_several_choices(paralon):
    """The agent worker answers `n` choices and prompt lists, as vLLM does."""
    client = paralon.openai()
    answer = client.chat.completions.create(model=paralon.model("agent"), messages=HELLO, max_tokens=3, n=2)
    assert sorted(c.index for c in answer.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.message.content for c in answer.choices)
    assert answer.usage.completion_tokens == 6
    indexes = {c.choices[0].index for c in client.chat.completions.create(
        model=paralon.model("agent"), messages=HELLO, max_tokens=3, n=2, stream=True) if c.choices}
    assert indexes == {0, 1}
    listed = client.completions.create(model=paralon.model("agent"), prompt=["One", "Two"], max_tokens=2)
    assert sorted(c.index for c in listed.choices) == [0, 1]
    paralon.check()


# --- the Responses API --------------------------------------------------------


def test_responses_create_and_follow_up(paralon):
    paralon.requires_route("/v1/responses")
    client = paralon.openai()
    # The simulated worker writes until max_output_tokens: an incomplete response, as vLLM answers.
    first = client.responses.create(model=paralon.model(), input="Say something.", max_output_tokens=8)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens" and first.output_text
    assert usd_to_nano_usd_exact(first.usage.model_extra["cost"]) > 0
    follow_up = client.responses.create(model=paralon.model(), previous_response_id=first.id, max_output_tokens=16,
                                        input=[{"role": "user", "content": "And again."}])
    assert follow_up.status == "completed" and follow_up.output_text and follow_up.usage.input_tokens > first.usage.input_tokens
    paralon.check()


def test_responses_stream(paralon):
    paralon.requires_route("/v1/responses")
    client = paralon.openai()
    # The answer ends before max_output_tokens (conftest.TEXT_ANSWER_TOKENS): a completed response.
    with client.responses.stream(model=paralon.model(), input="Say something.", max_output_tokens=16) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas and "".join(deltas) == final.output_text
    paralon.check()


def test_responses_function_tool(paralon):
    paralon.requires_route("/v1/responses")
    client = paralon.openai()
    tool = {"type": "function", "name": "search", "description": "Search the catalogue.",
            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}
    answer = client.responses.create(model=paralon.model(), input="Find me three warm mats.", tools=[tool],
                                     max_output_tokens=16)
    calls = [item for item in answer.output if item.type == "function_call"]
    assert calls and calls[0].name == "search" and calls[0].call_id
    assert set(json.loads(calls[0].arguments)) == {"input"}
    reply = client.responses.create(model=paralon.model(), previous_response_id=answer.id, tools=[tool],
                                    max_output_tokens=16,
                                    input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": '{"results": ["mat 1"]}'}])
    assert reply.output_text
    paralon.check()


# --- embeddings ------------------------------------------------------------------


def test_embeddings(paralon):
    paralon.requires_route("/v1/embeddings")
    client = paralon.openai()
    raw = client.embeddings.with_raw_response.create(model=paralon.model("embedding"), input=["one", "two words"])
    answer = raw.parse()
    assert [d.index for d in answer.data] == [0, 1] and len(answer.data[0].embedding) > 0
    assert answer.usage.prompt_tokens > 0
    as_base64 = client.embeddings.create(model=paralon.model("embedding"), input="one", encoding_format="base64")
    floats = len(base64.b64decode(as_base64.data[0].embedding)) // FLOAT32_BYTES
    assert floats == len(answer.data[0].embedding)
    paralon.check()


# --- models and errors ---------------------------------------------------------------


def test_models_list_and_retrieve(paralon):
    client = paralon.openai()
    listed = {m.id: m for m in client.models.list().data}
    assert paralon.model() in listed and paralon.model("agent") in listed
    assert listed[paralon.model()].model_extra["pricing"]["output_nano_usd_per_token"] == 600
    one = client.models.retrieve(paralon.model())
    assert one.id == paralon.model() and one.owned_by
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    paralon.check()


def _refused(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value


def test_errors_have_openai_shapes_and_cost_nothing(paralon):
    client = paralon.openai(max_retries=0)
    bad_key = _refused(lambda: paralon.openai(api_key="sk-par-nope").chat.completions.create(
        model=paralon.model(), messages=HELLO))
    assert isinstance(bad_key, openai.AuthenticationError)
    unknown = _refused(lambda: client.chat.completions.create(model="no-such-model", messages=HELLO))
    assert isinstance(unknown, openai.NotFoundError) and unknown.code == "model_not_found"
    empty = _refused(lambda: client.chat.completions.create(model=paralon.model(), messages=[]))
    assert isinstance(empty, openai.BadRequestError) and empty.body["type"] == "invalid_request_error"
    paralon.check()


def test_errors_a_retry_cannot_fix_are_not_retried(paralon):
    """With the SDK's default retries: one request each for a bad body, no credits and a spent key."""
    bad_body = _refused(lambda: paralon.openai().chat.completions.create(
        model=paralon.model(), messages=[{"role": "user"}]))
    assert isinstance(bad_body, openai.BadRequestError) and bad_body.param
    broke = _refused(lambda: paralon.openai(api_key=paralon.served.broke_key).chat.completions.create(
        model=paralon.model(), messages=HELLO, max_tokens=5))
    assert broke.status_code == 402
    spent = _refused(lambda: paralon.openai(api_key=paralon.served.limited_key).chat.completions.create(
        model=paralon.model(), messages=HELLO, max_tokens=5))
    assert isinstance(spent, openai.RateLimitError) and spent.code == "insufficient_quota"
    assert len(paralon.recorder.exchanges) == 3, [str(e) for e in paralon.recorder.exchanges]
    assert all(e.headers.get("x-should-retry") == "false" for e in paralon.recorder.exchanges)
    paralon.check()
