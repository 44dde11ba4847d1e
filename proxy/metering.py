"""What a request may cost before it runs, and what it costs after.

Without a tokenizer both sides of a request are bounded from above by bytes: a
byte-level tokenizer never makes more tokens than the UTF-8 bytes it is given.

- The prompt: every byte the engine's chat template can render (content
  strings and text parts, names, tool calls and their ids, tool replies,
  reasoning sent back, tool definitions, response_format schemas), plus the
  template's own overhead per request, per message, per tool call and per
  tool. Structured values (tools, schemas, tool-call arguments) are counted
  as a template's `tojson` may render them: spaced separators, indented up to
  four spaces (`json_bytes_bound`).
- The completion: the bytes the caller actually received (text, reasoning,
  tool-call names and arguments), plus allowances for what engines generate
  but never relay: the longest stop string asked for (held back while it may
  still match, finished or not), the stop token and the tags a reasoning
  parser strips once the choice finished, and the markup a tool parser strips
  per tool call of a function the caller offered (at most
  TOOL_CALLS_PER_ANSWER_MAX). How the worker chunks its output does not move
  it: splitting, repeating or padding adds only the bytes relayed. Logprobs
  repeat the relayed tokens and are never counted. With n > 1 or a list of
  prompts each choice is counted on its own (`ChoiceOutputs`): its own
  max_tokens, its own allowances, the bound being their sum.

Workers are paid by the tokens they report, so the report is billed when it
is within the bound, else the bound. A completion reported above the bound of
a finished answer the proxy counted itself, or choices the proxy had to drop,
are evidence against the worker. An answer that did not finish (the caller
left, the worker failed, max_tokens cut it) is never proof: the engine may
hold back text it has already counted. A prompt reported above its bound is
only a discrepancy (a caller can cause that with a template we do not know)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

import orjson

from ledger.errors import a_or_an
from ledger.money import PERCENT
from proxy.errors import InvalidRequest
from proxy.limits import (
    CHOICES_PER_PROMPT_MAX,
    CHOICES_PER_REQUEST_MAX,
    COMPLETION_ALLOWANCE_TOKENS_PER_FINISH,
    COMPLETION_ALLOWANCE_TOKENS_PER_TOOL_CALL,
    COMPLETION_TOLERANCE_PERCENT,
    COMPLETION_TOLERANCE_TOKENS_MIN,
    MAX_TOKENS_LIMIT,
    MAX_TOKENS_WITHOUT_CONTEXT,
    PROMPTS_PER_REQUEST_MAX,
    TEMPLATE_JSON_INDENT_RATIO_MAX,
    TEMPLATE_TOKENS_PER_CONTENT_PART,
    TEMPLATE_TOKENS_PER_MESSAGE,
    TEMPLATE_TOKENS_PER_REASONING,
    TEMPLATE_TOKENS_PER_REQUEST,
    TEMPLATE_TOKENS_PER_TOOL,
    TEMPLATE_TOKENS_PER_TOOL_CALL,
    TEMPLATE_TOKENS_PER_TOOL_REPLY,
    TEMPLATE_TOKENS_WITH_TOKEN_IDS,
    TEMPLATE_TOKENS_WITH_TOOLS,
)
from proxy.prices import Price

TEXT_PART_TYPES = frozenset({"text", "input_text", "refusal"})

STRIKE_COMPLETION_ABOVE_BOUND = "completion_above_bound"
STRIKE_MALFORMED_CHOICES = "malformed_choices"

# The keys of a message, a tool call and a content part that the prompt bound
# counts: only these reach a worker (forwarded_fields.py), for a template may
# render any key it is given. Keys counted as their string's bytes are
# forwarded only when they hold a string.
MESSAGE_STRING_KEYS = ("name", "tool_call_id", "reasoning_content", "reasoning", "refusal")
TOOL_CALL_STRING_KEYS = ("id", "type")
FUNCTION_KEYS = ("name", "arguments")  # the name as its bytes, the arguments as sent or re-rendered


def utf8_bytes(value: object) -> int:
    """The UTF-8 bytes of a string; nothing for anything else."""
    return len(value.encode()) if isinstance(value, str) else 0


def json_bytes_bound(value: object) -> int:
    """Bytes of `value` as a chat template's `tojson` may render it: Python's
    separators (", ", ": ") and number format, or indented up to four spaces.
    Indenting by four adds at most twice what indenting by two adds."""
    try:
        compact = len(orjson.dumps(value))
        indented = len(orjson.dumps(value, option=orjson.OPT_INDENT_2))
    except (TypeError, orjson.JSONEncodeError):
        raise InvalidRequest("the request holds a value that is not JSON") from None
    return len(json.dumps(value, ensure_ascii=False).encode()) + TEMPLATE_JSON_INDENT_RATIO_MAX * (indented - compact)


def _content_bytes(content: object, param: str) -> int:
    if content is None or isinstance(content, str):
        return utf8_bytes(content)
    if not isinstance(content, list):
        raise InvalidRequest("message content must be a string or a list of text parts", param=param)
    total = 0
    for part in content:
        if not isinstance(part, dict):
            raise InvalidRequest("each content part must be an object", param=param)
        kind = part.get("type")
        if kind not in TEXT_PART_TYPES:
            raise InvalidRequest(f"content parts of type {kind!r} are not supported yet: send text parts only", param=param)
        text = part.get(content_part_text_key(kind))
        if not isinstance(text, str):
            raise InvalidRequest(f"{a_or_an(kind)} part needs its text as a string", param=param)
        total += TEMPLATE_TOKENS_PER_CONTENT_PART + len(text.encode())
    return total


def content_part_text_key(kind: str) -> str:
    """The key of a text part whose bytes are counted (and forwarded)."""
    return "refusal" if kind == "refusal" else "text"


def _arguments_bytes(arguments: object) -> int:
    """Tool-call arguments as sent, or as an engine re-renders them once
    parsed (vLLM parses the JSON string and the template dumps it again)."""
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return len(arguments.encode())
        return max(len(arguments.encode()), json_bytes_bound(parsed))
    return json_bytes_bound(arguments) if arguments is not None else 0


def _tool_calls_bytes(tool_calls: object, param: str) -> int:
    if tool_calls is None:
        return 0
    if not isinstance(tool_calls, list):
        raise InvalidRequest("tool_calls must be a list", param=param)
    total = 0
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidRequest("each tool call needs a function object", param=param)
        total += (TEMPLATE_TOKENS_PER_TOOL_CALL + utf8_bytes(call.get("id")) + utf8_bytes(call.get("type"))
                  + utf8_bytes(function.get("name")) + _arguments_bytes(function.get("arguments")))
    return total


def _message_tokens_bound(message: object, index: int) -> int:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequest("each message needs a role", param=param)
    role = message["role"]
    total = TEMPLATE_TOKENS_PER_MESSAGE + len(role.encode()) + _content_bytes(message.get("content"), param + ".content")
    total += sum(utf8_bytes(message.get(key)) for key in ("name", "tool_call_id", "refusal"))
    if role == "tool" or role == "function":
        total += TEMPLATE_TOKENS_PER_TOOL_REPLY
    reasoning = utf8_bytes(message.get("reasoning_content")) + utf8_bytes(message.get("reasoning"))
    if reasoning:
        total += TEMPLATE_TOKENS_PER_REASONING + reasoning
    total += _tool_calls_bytes(message.get("tool_calls"), param + ".tool_calls")
    if message.get("function_call") is not None:  # the deprecated single call
        total += TEMPLATE_TOKENS_PER_TOOL_CALL + json_bytes_bound(message["function_call"])
    return total


def _tools_tokens_bound(body: dict) -> int:
    total = 0
    for field in ("tools", "functions"):
        tools = body.get(field)
        if tools is None:
            continue
        if not isinstance(tools, list):
            raise InvalidRequest(f"{field} must be a list", param=field)
        if tools:
            total += TEMPLATE_TOKENS_WITH_TOOLS + len(tools) * TEMPLATE_TOKENS_PER_TOOL + json_bytes_bound(tools)
    return total


def prompt_tokens_bound(kind: str, body: dict) -> int:
    """An upper bound on the prompt's tokens; also validates its shape."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list", param="messages")
        total = TEMPLATE_TOKENS_PER_REQUEST + _tools_tokens_bound(body)
        for index, message in enumerate(messages):
            total += _message_tokens_bound(message, index)
        for field in ("response_format", "tool_choice", "function_call"):
            value = body.get(field)
            if value is not None:
                total += len(value.encode()) if isinstance(value, str) else json_bytes_bound(value)
        return total + utf8_bytes(body.get("reasoning_effort"))
    return sum(completion_prompt_bounds(body))


def completion_prompt_bounds(body: dict) -> list[int]:
    """The bound of each prompt of a /v1/completions request: a string or a
    list of token ids, or a list of either (each prompt counted once)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > PROMPTS_PER_REQUEST_MAX:
            raise InvalidRequest(f"at most {PROMPTS_PER_REQUEST_MAX} prompts per request", param="prompt")
        return [_one_prompt_bound(p) for p in prompt]
    return [_one_prompt_bound(prompt)]


def _one_prompt_bound(prompt: object) -> int:
    if isinstance(prompt, str):
        return TEMPLATE_TOKENS_PER_REQUEST + len(prompt.encode())
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return TEMPLATE_TOKENS_WITH_TOKEN_IDS + len(prompt)
    raise InvalidRequest("prompt must be a string, a list of token ids, or a list of either", param="prompt")


def prompts_of(kind: str, body: dict) -> int:
    """How many prompts a request holds (a validated body): chat has one."""
    return 1 if kind == "chat" else len(completion_prompt_bounds(body))


def choices_per_prompt(body: dict) -> int:
    """`n`, from 1 to CHOICES_PER_PROMPT_MAX; absent or null is 1."""
    n = body.get("n")
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= CHOICES_PER_PROMPT_MAX:
        raise InvalidRequest(f"n must be an integer from 1 to {CHOICES_PER_PROMPT_MAX}", param="n")
    return n


def requested_choices(kind: str, body: dict) -> int:
    """The choices a request asks for: n per prompt, numbered prompt_index * n + j."""
    choices = choices_per_prompt(body) * prompts_of(kind, body)
    if choices > CHOICES_PER_REQUEST_MAX:
        raise InvalidRequest(f"n times the number of prompts must be at most {CHOICES_PER_REQUEST_MAX}", param="n")
    return choices


def requested_max_tokens(kind: str, body: dict) -> int | None:
    """max_completion_tokens (OpenAI's newer name, on either route) before max_tokens."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if type(value) is not int or not 1 <= value <= MAX_TOKENS_LIMIT:
            raise InvalidRequest(f"{name} must be an integer from 1 to {MAX_TOKENS_LIMIT}", param=name)
        return value
    return None


def planned_max_tokens(asked_max_tokens: int | None, prompt_bound: int, context_lengths: list[int | None]) -> int:
    """max_tokens for the hold: what the caller asked for, else the room the
    largest known context of the candidates leaves; never more than that room
    when every candidate has told its context length."""
    known_contexts = [context for context in context_lengths if context]
    room = max(max(known_contexts) - prompt_bound, 1) if known_contexts else MAX_TOKENS_WITHOUT_CONTEXT
    max_tokens = asked_max_tokens or room
    if len(known_contexts) == len(context_lengths):
        max_tokens = min(max_tokens, room)
    return max_tokens


def offered_tool_names(body: dict | None) -> frozenset[str]:
    """The function names a request offered (`tools`, or the deprecated `functions`)."""
    names = []
    for field_name in ("tools", "functions"):
        tools = (body or {}).get(field_name)
        for tool in tools if isinstance(tools, list) else ():
            function = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                names.append(function["name"])
    return frozenset(names)


def stop_bytes_max(body: dict | None) -> int:
    """The longest stop string asked for: an engine generates it but does not relay it."""
    stop = (body or {}).get("stop")
    if isinstance(stop, str):
        return len(stop.encode())
    if isinstance(stop, list):
        return max((utf8_bytes(s) for s in stop), default=0)
    return 0


class HoldPlan(NamedTuple):
    amount_nano_usd: int  # covers max_tokens as asked (or the whole context)
    minimum_nano_usd: int  # covers the prompt and one token


def plan_hold(price: Price, prompt_bound: int, max_tokens: int, choices: int = 1) -> HoldPlan:
    """max_tokens is per choice: every choice may use all of it."""
    prompt_cost = prompt_bound * price.input_nano_usd_per_token
    return HoldPlan(prompt_cost + choices * max_tokens * price.output_nano_usd_per_token,
                    prompt_cost + choices * price.output_nano_usd_per_token)


def affordable_max_tokens(price: Price, prompt_bound: int, held_nano_usd: int, choices: int = 1) -> int:
    """The most completion tokens per choice a granted hold pays for."""
    return (held_nano_usd - prompt_bound * price.input_nano_usd_per_token) // (choices * price.output_nano_usd_per_token)


@dataclass(slots=True)
class OutputCount:
    """What the proxy relayed of one request's output, as the caller received it."""
    relayed_bytes: int = 0  # UTF-8 bytes of text, reasoning, tool-call names and arguments
    relayed_chunks: int = 0  # chunks that carried at least one byte of output
    finished: bool = False  # a finish_reason was relayed, or the worker ended the stream ([DONE])
    stop_bytes: int = 0  # the longest stop string asked for, generated but not relayed
    tool_calls_opened: int = 0  # tool calls relayed, indexed 0, 1, 2, ... (never above TOOL_CALLS_PER_ANSWER_MAX)
    tool_call_indexes: set[int] = field(default_factory=set)  # of those, calls to an offered function
    dropped: int = 0  # malformed or duplicate choices and tool-call entries, never relayed

    def completion_bound(self) -> int:
        """No byte-level tokenizer makes more tokens than this of what was relayed.
        A stop string is held back while it may still match, so it is allowed
        whether or not the answer finished."""
        finish = COMPLETION_ALLOWANCE_TOKENS_PER_FINISH if self.finished else 0
        return (self.relayed_bytes + finish + self.stop_bytes
                + len(self.tool_call_indexes) * COMPLETION_ALLOWANCE_TOKENS_PER_TOOL_CALL)


@dataclass(slots=True)
class ChoiceOutputs:
    """What the proxy relayed of every choice of a request (n per prompt),
    each choice counted on its own: max_tokens holds per choice, and the
    completion bound is the sum of the choices' bounds."""
    choices: list[OutputCount]
    dropped_choices: int = 0  # duplicate, out-of-range or malformed choices, never relayed
    max_tokens_per_choice: int | None = None  # no choice is billed more than this, whatever it relayed

    @classmethod
    def of(cls, count: int, stop_bytes: int = 0) -> "ChoiceOutputs":
        return cls([OutputCount(stop_bytes=stop_bytes) for _ in range(count)])

    @property
    def relayed_bytes(self) -> int:
        return sum(choice.relayed_bytes for choice in self.choices)

    @property
    def relayed_chunks(self) -> int:
        return sum(choice.relayed_chunks for choice in self.choices)

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    @property
    def dropped(self) -> int:
        return self.dropped_choices + sum(choice.dropped for choice in self.choices)

    @property
    def tool_call_indexes(self) -> set[int]:
        return set().union(*(choice.tool_call_indexes for choice in self.choices))

    def finish_all(self) -> None:
        """The stream ended: every choice that relayed output is finished."""
        for choice in self.choices:
            if choice.relayed_chunks:
                choice.finished = True

    def completion_bound(self) -> int:
        """The sum of the choices' bounds; a choice the worker never sent
        (one that ignored n) earns no allowance."""
        cap = self.max_tokens_per_choice
        return sum(choice.completion_bound() if cap is None else min(choice.completion_bound(), cap)
                   for choice in self.choices if choice.relayed_chunks or choice.finished)


class BilledUsage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    discrepant: bool  # the worker reported more than this, or there is evidence against it
    strike_reason: str | None  # proof against the worker on its own (STRIKE_*)


def billable_usage(reported_prompt: int | None, reported_completion: int | None, *,
                   prompt_bound: int, output: OutputCount | ChoiceOutputs) -> BilledUsage:
    """The worker's report where it is within the proxy's bounds, else the bound.
    A missing completion report bills the chunks relayed (llama.cpp streams no
    usage, one token per chunk), a missing prompt report the prompt's bound.
    Nothing above a bound is ever billed; the tolerance only decides when a
    report above it is a discrepancy, and it is proof against the worker only
    when the answer finished: until then an engine holds back text it has
    counted (a partial stop string, the bytes of an unfinished character)."""
    completion_bound = output.completion_bound()
    tolerance = max(COMPLETION_TOLERANCE_TOKENS_MIN, completion_bound * COMPLETION_TOLERANCE_PERCENT // PERCENT)
    completion, prompt, over_reported, strike_reason = output.relayed_chunks, prompt_bound, False, None
    if reported_completion is not None:
        completion = min(reported_completion, completion_bound)
        if reported_completion > completion_bound + tolerance:
            over_reported = True
            strike_reason = STRIKE_COMPLETION_ABOVE_BOUND if output.finished else None
    if reported_prompt is not None:
        if reported_prompt > prompt_bound:
            over_reported = True
        else:
            prompt = reported_prompt
    if strike_reason is None and output.dropped:
        strike_reason = STRIKE_MALFORMED_CHOICES
    return BilledUsage(prompt, completion, over_reported or strike_reason is not None, strike_reason)
