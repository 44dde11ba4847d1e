"""The `litellm` SDK, unchanged, against `paralon serve` (model "openai/<model>",
`api_base`): completion, streaming, tool calls, acompletion. Any warning fails
the test (a `usage.cost` sent as a string once made litellm warn on every
call); every body and stream event it received is checked against OpenAI's
OpenAPI document. LITELLM_LOCAL_MODEL_COST_MAP is set by conftest.py."""
from __future__ import annotations

import asyncio
import json

import litellm
import pytest

from tests.conformance.conftest import CLIENT_WARNINGS_ARE_ERRORS, LITELLM_SCHEMA_WARNING

# Its stream of a usage chunk reads `model_fields` and `model_computed_fields` off an instance,
# which pydantic 2.11 deprecates: litellm's own code, nothing about the answers.
pytestmark = [
    *CLIENT_WARNINGS_ARE_ERRORS,
    LITELLM_SCHEMA_WARNING,
    pytest.mark.filterwarnings(r"ignore:Accessing the 'model_(computed_)?fields' attribute on the instance is deprecated"
                               r":pydantic.warnings.PydanticDeprecatedSince211"),
]

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


def _call(paralon, kind: str = "text") -> dict:
    return {"model": f"openai/{paralon.model(kind)}", "api_base": paralon.base_url, "api_key": paralon.key}


def test_completion(paralon):
    answer = litellm.completion(**_call(paralon), messages=HELLO, max_tokens=5)
    assert answer.choices[0].message.content.strip()
    assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"
    paralon.check()


def test_streaming(paralon):
    chunks = list(litellm.completion(**_call(paralon), messages=HELLO, max_tokens=4, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    paralon.check()


def test_streaming_with_usage(paralon):
    chunks = list(litellm.completion(**_call(paralon), messages=HELLO, max_tokens=4, stream=True,
                                     stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens == 4
    paralon.check()


def test_tool_calls(paralon):
    answer = litellm.completion(**_call(paralon, "agent"), messages=[{"role": "user", "content": "Find warm mats."}],
                                tools=[SEARCH_TOOL])
    calls = answer.choices[0].message.tool_calls
    assert calls, f"no tool calls in {answer.choices[0].message}"
    assert calls[0].function.name == "search" and set(json.loads(calls[0].function.arguments)) == {"query", "limit"}
    paralon.check()


def test_streaming_tool_calls(paralon):
    stream = litellm.completion(**_call(paralon, "agent"), messages=[{"role": "user", "content": "Find warm mats."}],
                                tools=[SEARCH_TOOL], stream=True)
    arguments, names = "", []
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [call.function.name] if call.function.name else []
            arguments += call.function.arguments or ""
    assert names == ["search"] and set(json.loads(arguments)) == {"query", "limit"}
    paralon.check()


def test_acompletion(paralon):
    async def main():
        return await asyncio.gather(*(litellm.acompletion(**_call(paralon), max_tokens=3,
                                                          messages=[{"role": "user", "content": f"question {i}"}])
                                      for i in range(4)))

    answers = asyncio.run(main())
    assert all(a.usage.completion_tokens == 3 for a in answers)
    paralon.check()
