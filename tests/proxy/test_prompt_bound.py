"""The prompt bound is never below what a real tokenizer counts with a real chat
template, for conversations of every shape an agent framework sends.

The tokenizer is the tiny test model's (tests/proxy/tiny_gguf.py): byte-level
BPE with almost no merges, so it makes nearly one token per byte, the worst
case the bound must hold for. The templates are Hermes/Qwen-style ChatML as
vLLM and llama.cpp render it (tools preamble, <tool_call> and <tool_response>
markup, <think> around reasoning sent back, text parts joined by newlines),
with `tojson` as Transformers and llama-cpp-python define it, plain and
indented. The conversation is formatted in-process by llama-cpp-python's own
`Jinja2ChatFormatter` and tokenized by `llama_cpp.Llama` (vocab only)."""
from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy import metering
from tests.support.tiny_gguf import IM_END, IM_START, write_tiny_model

llama_cpp = pytest.importorskip("llama_cpp")
from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: E402

EXAMPLES_MAX = 200

HERMES_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}{{ part.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- render(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson(indent=INDENT) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + render(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.reasoning_content -%}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- render(message.content) + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>' + message.role -}}"
    "{%- if message.reasoning_content -%}{{- '\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n' -}}{%- endif -%}"
    "{%- if message.content -%}{{- '\\n' + render(message.content) -}}{%- endif -%}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' -}}"
    "{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}"
    "{%- else -%}{{- tool_call.arguments | tojson(indent=INDENT) -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render(message.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TEMPLATES = {
    "tojson": HERMES_TEMPLATE.replace("(indent=INDENT)", ""),
    "tojson indented": HERMES_TEMPLATE.replace("INDENT", "4"),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def formatters():
    return {name: Jinja2ChatFormatter(template, eos_token=IM_END, bos_token=IM_START) for name, template in TEMPLATES.items()}


# --- conversations ---------------------------------------------------------------

# Unicode of every width: ASCII, accents, CJK, emoji, and the JSON-special characters.
texts = st.text(st.one_of(st.characters(codec="utf-8"), st.sampled_from("\"\\\n\t<>&'{}😀🦀é中")), max_size=40)
names = st.text(string.ascii_letters + "_", min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
contents = texts | st.lists(st.builds(lambda t: {"type": "text", "text": t}, texts), min_size=1, max_size=3)


@st.composite
def tool_calls(draw):
    return [{"id": draw(texts), "type": "function",
             "function": {"name": draw(names), "arguments": json.dumps(draw(st.dictionaries(names, json_values, max_size=3)),
                                                                       ensure_ascii=draw(st.booleans()))}}
            for _ in range(draw(st.integers(1, 3)))]


@st.composite
def messages(draw):
    role = draw(st.sampled_from(["system", "user", "assistant", "assistant_tools", "tool"]))
    if role == "assistant_tools":
        message = {"role": "assistant", "content": draw(st.none() | contents), "tool_calls": draw(tool_calls())}
    elif role == "tool":
        message = {"role": "tool", "tool_call_id": draw(texts), "content": draw(contents)}
        if draw(st.booleans()):
            message["name"] = draw(names)
    else:
        message = {"role": role, "content": draw(contents)}
    if message["role"] == "assistant" and draw(st.booleans()):
        message["reasoning_content"] = draw(texts)
    return message


tools = st.lists(st.builds(
    lambda name, description, properties: {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": "string", "description": d} for p, d in properties.items()}}}},
    names, texts, st.dictionaries(names, texts, max_size=3)), max_size=3)
response_formats = st.none() | st.builds(
    lambda schema: {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}, json_values)


def _as_vllm_renders(messages: list[dict]) -> list[dict]:
    """vLLM parses tool-call arguments before the template sees them."""
    parsed = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                     for c in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        parsed.append(message)
    return parsed


@settings(max_examples=EXAMPLES_MAX, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=st.lists(messages(), min_size=1, max_size=6), tool_list=tools, response_format=response_formats,
       template=st.sampled_from(sorted(TEMPLATES)), arguments_parsed=st.booleans())
def test_the_prompt_bound_is_never_below_a_real_tokenizers_count(tokenizer, formatters, conversation, tool_list,
                                                                  response_format, template, arguments_parsed):
    body = {"messages": conversation}
    if tool_list:
        body["tools"] = tool_list
    if response_format is not None:
        body["response_format"] = response_format
    bound = metering.prompt_tokens_bound("chat", body)
    rendered = _as_vllm_renders(conversation) if arguments_parsed else conversation
    prompt = formatters[template](messages=rendered, tools=tool_list or None).prompt
    tokens = tokenizer.tokenize(prompt.encode(), add_bos=False, special=True)
    assert len(tokens) <= bound


def test_the_template_renders_what_the_bound_must_count(formatters, tokenizer):
    """The property above is only as strong as the template: it renders every part."""
    conversation = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "U1"}, {"type": "text", "text": "U2"}]},
        {"role": "assistant", "content": None, "reasoning_content": "R",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "FN", "arguments": '{"k": "ARG"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "RESULT"},
    ]
    tool_list = [{"type": "function", "function": {"name": "TOOLNAME", "parameters": {}}}]
    for formatter in formatters.values():
        prompt = formatter(messages=conversation, tools=tool_list).prompt
        for part in ("S", "U1\nU2", "<think>\nR\n</think>", '"name": "FN"', '"ARG"', "<tool_response>\nRESULT", "TOOLNAME"):
            assert part in prompt
        assert len(tokenizer.tokenize(prompt.encode(), add_bos=False, special=True)) <= metering.prompt_tokens_bound(
            "chat", {"messages": conversation, "tools": tool_list})
