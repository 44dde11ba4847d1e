"""What a request may cost before it runs, and what it costs after.

Without a tokenizer the prompt is bounded from above: a byte-level tokenizer
never makes more tokens than UTF-8 bytes, plus the chat template's overhead.
Workers are paid by the tokens they report, so their report is checked
against the proxy's own count, and the lower is billed beyond a tolerance."""
from __future__ import annotations

from typing import NamedTuple

import orjson

from proxy.errors import InvalidRequest
from proxy.prices import Price

TEMPLATE_TOKENS_PER_MESSAGE = 8
TEMPLATE_TOKENS_PER_REQUEST = 16
COMPLETION_TOLERANCE_TOKENS_MIN = 2
COMPLETION_TOLERANCE_PERCENT = 5
MAX_TOKENS_LIMIT = 1_000_000
COMPLETION_ABOVE_COUNT = "completion_above_count"  # more completion reported than was relayed: proof on one request


def _text_bytes(content: object) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content.encode())
    if isinstance(content, list):
        total = 0
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest("only text content parts are supported", param="messages")
            total += len(part["text"].encode())
        return total
    raise InvalidRequest("message content must be a string or a list of text parts", param="messages")


def prompt_tokens_bound(kind: str, body: dict) -> int:
    """An upper bound on the prompt's tokens; also validates its shape."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list", param="messages")
        total = TEMPLATE_TOKENS_PER_REQUEST
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequest("each message needs a role", param="messages")
            total += TEMPLATE_TOKENS_PER_MESSAGE + _text_bytes(message.get("content"))
        for extra in ("tools", "functions", "response_format"):
            if body.get(extra) is not None:
                total += len(orjson.dumps(body[extra]))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return TEMPLATE_TOKENS_PER_REQUEST + len(prompt.encode())
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return len(prompt)
    raise InvalidRequest("prompt must be a string or a list of token ids (one prompt per request)", param="prompt")


def requested_max_tokens(kind: str, body: dict) -> int | None:
    value = body.get("max_completion_tokens") if kind == "chat" else None
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise InvalidRequest(f"max_tokens must be an integer from 1 to {MAX_TOKENS_LIMIT}", param="max_tokens")
    return value


class HoldPlan(NamedTuple):
    amount_nano_usd: int  # covers max_tokens as asked (or the whole context)
    minimum_nano_usd: int  # covers the prompt and one token


def plan_hold(price: Price, prompt_bound: int, max_tokens: int) -> HoldPlan:
    prompt_cost = prompt_bound * price.input_nano_usd_per_token
    return HoldPlan(prompt_cost + max_tokens * price.output_nano_usd_per_token,
                    prompt_cost + price.output_nano_usd_per_token)


def affordable_max_tokens(price: Price, prompt_bound: int, held_nano_usd: int) -> int:
    """The most completion tokens a granted hold pays for."""
    return (held_nano_usd - prompt_bound * price.input_nano_usd_per_token) // price.output_nano_usd_per_token


class BilledUsage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    discrepant: bool  # the worker reported more than this
    strike_reason: str | None = None  # set when this one request proves the worker dishonest


def billable_usage(reported_prompt: int | None, reported_completion: int | None, *,
                   prompt_bound: int, counted_completion: int) -> BilledUsage:
    """The lower of what the worker reported and what the proxy can vouch for.
    A missing report bills what the proxy counted (and the bound for the prompt)."""
    tolerance = max(COMPLETION_TOLERANCE_TOKENS_MIN, counted_completion * COMPLETION_TOLERANCE_PERCENT // 100)
    completion, prompt, discrepant = counted_completion, prompt_bound, False
    strike_reason = None
    if reported_completion is not None:
        if reported_completion > counted_completion + tolerance:
            discrepant, strike_reason = True, COMPLETION_ABOVE_COUNT
        else:
            completion = reported_completion
    if reported_prompt is not None:
        if reported_prompt > prompt_bound:
            discrepant = True
        else:
            prompt = reported_prompt
    return BilledUsage(prompt, completion, discrepant, strike_reason)
