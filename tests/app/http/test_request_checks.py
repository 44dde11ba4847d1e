"""Chat and completions bodies are checked against OpenAI's API document
(proxy/request_checks.py) before anything is held: a 400 in OpenAI's error
shape whose `param` names the field, and not a nano-dollar held or charged.
Fields OpenAI does not define that engines take (vLLM's top_k, min_p,
guided_json, chat_template_kwargs, ...) pass. The site's workers are all
unreachable, so a body that passes the checks meets a 503 (no worker), which
is how these tests tell "accepted" from "refused"."""
from __future__ import annotations

import openai
import pytest

from tests.app.http.conftest import MODEL
from tests.support import harness
from tests.support.harness import make_fleet, serving, sim_worker

ERROR_FIELDS = {"message", "type", "param", "code"}
USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}

BAD_CHAT = [
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stream": 1}, "stream", "invalid_type"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "invalid_type"),
    ({"stream_options": []}, "stream_options", "invalid_type"),
    ({"messages": [USER, {"role": "assistant", "content": "ok"}, {"role": "user"}]}, "messages[2]", "missing_required_parameter"),
    ({"messages": [USER, {"role": "user", "content": None}]}, "messages[1]", "missing_required_parameter"),
    ({"messages": [USER, {"role": "assistant"}]}, "messages[1]", "missing_required_parameter"),
    ({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": []}]}, "messages[1]", "missing_required_parameter"),
    ({"messages": [{"role": "system"}, USER]}, "messages[0]", "missing_required_parameter"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [USER, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "empty_array"),
    ({"messages": [{"role": "user", "content": "hi", "name": 7}]}, "messages[0].name", "invalid_type"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "id": None}]}]},
     "messages[1].tool_calls[0].id", "missing_required_parameter"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}]},
     "messages[1].tool_calls[0].type", "invalid_value"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]}]},
     "messages[1].tool_calls[0].function.arguments", "invalid_type"),
    ({"temperature": 2.5}, "temperature", "decimal_above_max_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"top_p": -0.1}, "top_p", "decimal_below_min_value"),
    ({"frequency_penalty": 3}, "frequency_penalty", "decimal_above_max_value"),
    ({"presence_penalty": True}, "presence_penalty", "invalid_type"),
    ({"n": 0}, "n", "integer_below_min_value"),
    ({"n": 129}, "n", "integer_above_max_value"),
    ({"n": 1.5}, "n", "invalid_type"),
    ({"max_tokens": "16"}, "max_tokens", "invalid_type"),
    ({"max_completion_tokens": 1.0}, "max_completion_tokens", "invalid_type"),
    ({"logprobs": 3}, "logprobs", "invalid_type"),
    ({"top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
    ({"seed": 2**63}, "seed", "integer_above_max_value"),
    ({"stop": 5}, "stop", "invalid_type"),
    ({"stop": ["END", 5]}, "stop[1]", "invalid_type"),
    ({"logit_bias": {"50256": 101}}, "logit_bias.50256", "decimal_above_max_value"),
    ({"user": 42}, "user", "invalid_type"),
    ({"metadata": {"k": 1}}, "metadata.k", "invalid_type"),
    ({"tools": {"lookup": {}}}, "tools", "invalid_type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name", "missing_required_parameter"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function", "missing_required_parameter"),
    ({"tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_type"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value"),
    ({"service_tier": "gold"}, "service_tier", "invalid_value"),
    ({"model": 7}, "model", "invalid_type"),
]

BAD_COMPLETIONS = [
    ({"prompt": None}, "prompt", "missing_required_parameter"),
    ({"prompt": 42}, "prompt", "invalid_type"),
    ({"prompt": [[1, 2], []]}, "prompt", "invalid_value"),
    ({"prompt": ["a", 1]}, "prompt", "invalid_value"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "invalid_type"),
    ({"prompt": "x", "logprobs": 6}, "logprobs", "integer_above_max_value"),
    ({"prompt": "x", "echo": "yes"}, "echo", "invalid_type"),
    ({"prompt": "x", "best_of": 21}, "best_of", "integer_above_max_value"),
    ({"prompt": "x", "suffix": 3}, "suffix", "invalid_type"),
    ({"prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
]

# Each passes the checks (and reaches routing: 503, every worker of the site is unreachable).
GOOD_CHAT = [
    {"stream": None, "temperature": None, "n": 1, "stop": ["a", "b", "c", "d", "e"]},
    {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "guided_json": {"type": "object"},
     "chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"regex": "a+"}},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}, USER,
                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                  {"role": "function", "name": "lookup", "content": None}],
     "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}},
     "reasoning_effort": "low", "max_completion_tokens": 64, "logprobs": True, "top_logprobs": 5, "seed": -1},
    {"response_format": {"type": "structural_tag", "structures": [], "triggers": []}},
]
GOOD_COMPLETIONS = [
    {"prompt": "Once upon a time"},
    {"prompt": ["only one"], "max_completion_tokens": 8},
    {"prompt": [1, 2, 3], "logprobs": 5, "echo": False},
    {"prompt": [[1, 2], [3]], "top_k": 5, "min_p": 0.1},
]

# `paralon serve` took 35 s to listen on a machine loaded twentyfold: more than the harness waits.
SERVE_START_TIMEOUT_S = 120


def _refused(site, path: str, body: dict, param: str, code: str) -> None:
    before = site.money()
    response = site.call("POST", path, site.key, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error
    assert response.headers["x-should-retry"] == "false"
    assert site.money() == before, "nothing held, nothing charged"


@pytest.mark.parametrize(("fields", "param", "code"), BAD_CHAT)
def test_a_chat_body_openai_rules_out_is_a_400_naming_the_field(site, fields, param, code):
    _refused(site, "/v1/chat/completions", {"model": MODEL, "messages": [USER], **fields}, param, code)


@pytest.mark.parametrize(("fields", "param", "code"), BAD_COMPLETIONS)
def test_a_completions_body_openai_rules_out_is_a_400_naming_the_field(site, fields, param, code):
    _refused(site, "/v1/completions", {"model": MODEL, **fields}, param, code)


def test_missing_model_and_messages_are_named(site):
    _refused(site, "/v1/chat/completions", {"messages": [USER]}, "model", "missing_required_parameter")
    _refused(site, "/v1/chat/completions", {"model": MODEL}, "messages", "missing_required_parameter")


@pytest.mark.parametrize(("path", "fields"), [("/v1/chat/completions", {"messages": [USER], **f}) for f in GOOD_CHAT]
                         + [("/v1/completions", f) for f in GOOD_COMPLETIONS])
def test_what_openai_or_the_engines_accept_passes_the_checks(site, path, fields):
    before = site.money()
    response = site.call("POST", path, site.key, json={"model": MODEL, **fields})
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_worker_available", response.text
    assert site.money() == before


@pytest.fixture
def served(database_url, monkeypatch):
    monkeypatch.setattr(harness, "START_TIMEOUT_S", SERVE_START_TIMEOUT_S)
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url])
    with serving(database_url) as proxy:
        yield fleet, proxy
    worker.stop()
    fleet.engine.dispose()


def test_the_sdk_meets_the_checks_and_vllm_fields_reach_an_answer(served):
    """Against `paralon serve`: a bad body is the SDK's BadRequestError with
    `param`, asked once, nothing moved; vLLM's fields in extra_body are answered."""
    fleet, proxy = served
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key)  # the SDK's default retries
    balance = fleet.balance(fleet.customer_id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[USER, {"role": "user"}], max_tokens=4)
    assert refused.value.param == "messages[1]" and refused.value.code == "missing_required_parameter"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=4, stream="yes")
    assert refused.value.param == "stream"
    assert fleet.balance(fleet.customer_id) == balance and fleet.settlements() == [], "nothing held or charged"

    answer = client.chat.completions.create(
        model=MODEL, messages=[USER], max_tokens=4, temperature=0.5,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "chat_template_kwargs": {"enable_thinking": False}})
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 4
    assert len(fleet.settlements()) == 1
    fleet.assert_books_close()
