"""LangChain's `ChatOpenAI`, unchanged, against `paralon serve`: invoke,
stream, tools and structured output. Any warning fails the test; every body
and stream event it received is checked against OpenAI's OpenAPI document."""
from __future__ import annotations

import asyncio

from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.conformance.conftest import CLIENT_WARNINGS_ARE_ERRORS


pytestmark = CLIENT_WARNINGS_ARE_ERRORS

FIND_MATS = "Find me three warm mats."


class Search(BaseModel):
    """Search the catalogue."""

    query: str
    limit: int


def _chat(paralon, kind: str = "text", **options) -> ChatOpenAI:
    return ChatOpenAI(model=paralon.model(kind), base_url=paralon.base_url, api_key=paralon.key, **options)


def test_invoke(paralon):
    answer = _chat(paralon, max_tokens=5).invoke("Say something.")
    assert answer.content.strip()
    assert answer.usage_metadata["output_tokens"] == 5
    assert answer.response_metadata["finish_reason"] == "length"
    paralon.check()


def test_stream(paralon):
    chunks = list(_chat(paralon, max_tokens=6).stream("Say something."))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks).strip()
    paralon.check()


def test_stream_with_usage(paralon):
    whole = None
    for chunk in _chat(paralon, max_tokens=4, stream_usage=True).stream("Say something."):
        whole = chunk if whole is None else whole + chunk
    assert whole.usage_metadata["output_tokens"] == 4
    paralon.check()


def test_async_invoke_and_stream(paralon):
    async def main():
        chat = _chat(paralon, max_tokens=3)
        answers = await asyncio.gather(*(chat.ainvoke(f"question {i}") for i in range(4)))
        streamed = [c async for c in chat.astream("Say something.")]
        return answers, streamed

    answers, streamed = asyncio.run(main())
    assert all(a.usage_metadata["output_tokens"] == 3 for a in answers)
    assert "".join(c.content for c in streamed).strip()
    paralon.check()


def test_bind_tools_invoke(paralon):
    answer = _chat(paralon, "agent").bind_tools([Search]).invoke(FIND_MATS)
    assert answer.tool_calls, f"no tool calls in {answer!r}"
    call = answer.tool_calls[0]
    assert call["name"] == "Search" and call["id"]
    Search.model_validate(call["args"])
    paralon.check()


def test_bind_tools_stream(paralon):
    whole = None
    for chunk in _chat(paralon, "agent").bind_tools([Search]).stream(FIND_MATS):
        whole = chunk if whole is None else whole + chunk
    assert whole.tool_calls and whole.tool_calls[0]["name"] == "Search"
    Search.model_validate(whole.tool_calls[0]["args"])
    paralon.check()


def test_tool_round_trip(paralon):
    chat = _chat(paralon, "agent").bind_tools([Search])
    first = chat.invoke(FIND_MATS)
    reply = ToolMessage(content='{"results": ["mat 1", "mat 2", "mat 3"]}', tool_call_id=first.tool_calls[0]["id"])
    second = chat.invoke([HumanMessage(FIND_MATS), first, reply])
    assert second.content and not second.tool_calls
    paralon.check()


def test_structured_output_by_function_calling(paralon):
    found = _chat(paralon, "agent").with_structured_output(Search, method="function_calling").invoke(FIND_MATS)
    assert isinstance(found, Search)
    paralon.check()


def test_structured_output_by_json_schema(paralon):
    found = _chat(paralon, "agent").with_structured_output(Search, method="json_schema").invoke(
        "Three warm mats, as JSON.")
    assert isinstance(found, Search)
    paralon.check()
