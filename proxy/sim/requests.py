"""A request to the simulated worker, read as vLLM reads it, and vLLM's errors.

prompt_tokens = max(1, sum over messages of (UTF-8 bytes of what the template
renders of it // 4 + 4)): its content, and an assistant's tool-call names and
arguments, as an engine's chat template renders them; the tools list counts as
one more message. A /v1/completions prompt counts as one message. It never
exceeds those bytes + 8 per message, so a proxy can bound it without a tokenizer.

Completion length: `max_completion_tokens` (chat) or `max_tokens`, else 16;
`min_tokens`, `ignore_eos` and other sampling fields are accepted and ignored.
prompt_tokens + max_tokens above the context length is vLLM's 400.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.limits import SIM_MAX_TOKENS_DEFAULT, SIM_PROMPT_BYTES_PER_TOKEN, SIM_PROMPT_TOKENS_PER_MESSAGE
from proxy.sim.engine import GenerationRequest, chat_cache_bytes


class HttpError(Exception):
    """An error answered in vLLM's shape."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message

    def body(self) -> bytes:
        return orjson.dumps(
            {"object": "error", "message": self.message, "type": self.error_type, "param": None, "code": self.status}
        )


@dataclass(frozen=True, slots=True)
class Behaviour:
    """What a worker does to every request unless the request's own sim_* field says otherwise."""

    stop_after_tokens: int | None = None
    fail_after_tokens: int | None = None
    extra_tokens: int = 0
    inflate_usage: int = 1


def count_prompt_tokens(contents: list[bytes]) -> int:
    tokens = sum(len(c) // SIM_PROMPT_BYTES_PER_TOKEN + SIM_PROMPT_TOKENS_PER_MESSAGE for c in contents)
    return max(1, tokens)


def read_body_for_model(body: bytes, model: str) -> dict:
    """The request body as a JSON object asking for this worker's model (or none), as vLLM checks it."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    asked_model = data.get("model") or model
    if asked_model != model:
        raise HttpError(404, "NotFoundError", f"The model `{asked_model}` does not exist.")
    return data


def parse_request(body: bytes, *, chat: bool, model: str, max_model_len: int, behaviour: Behaviour) -> GenerationRequest:
    data = read_body_for_model(body, model)
    contents, prompt_bytes = chat_prompt(data.get("messages")) if chat else _completion_prompt(data.get("prompt"))
    if chat and data.get("tools"):
        contents.append(orjson.dumps(data["tools"]))
    prompt_tokens = count_prompt_tokens(contents)
    max_tokens = _requested_max_tokens(data, chat)
    if prompt_tokens + max_tokens > max_model_len:
        raise _context_error(max_model_len, prompt_tokens, max_tokens)
    sim_tokens = _optional_int(data, "sim_tokens", 0)
    if sim_tokens is None:
        sim_tokens = behaviour.stop_after_tokens
    extra_tokens = _optional_int(data, "sim_extra_tokens", 0)
    fail_after_tokens = _optional_int(data, "sim_fail_after_tokens", 0)
    stream = data.get("stream") is True
    include_usage, continuous_usage = _stream_flags(data, stream)
    stops_early = sim_tokens is not None and sim_tokens < max_tokens
    return GenerationRequest(
        chat=chat,
        prompt_bytes=prompt_bytes,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        completion_tokens=sim_tokens if stops_early else max_tokens + (behaviour.extra_tokens if extra_tokens is None else extra_tokens),
        finish_reason="stop" if stops_early else "length",
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        fail_before_first_token=bool(data.get("sim_fail_before_first_token")),
        fail_after_tokens=behaviour.fail_after_tokens if fail_after_tokens is None else fail_after_tokens,
        usage_multiplier=_optional_int(data, "sim_inflate_usage", 1) or behaviour.inflate_usage,
    )


def bad_request(message: str) -> HttpError:
    return HttpError(400, "BadRequestError", message)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise bad_request("message content must be a string or a list of parts")


def chat_prompt(messages: Any) -> tuple[list[bytes], bytes]:
    """Per-message contents, and the whole conversation as cache bytes."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list")
    contents: list[bytes] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("each message needs a role")
        contents.append(_content_text(message.get("content")).encode() + _tool_calls_text(message.get("tool_calls")))
    roles = [m["role"].encode() for m in messages]
    return contents, b"".join(chat_cache_bytes(r, c) for r, c in zip(roles, contents, strict=True))


def _tool_calls_text(tool_calls: Any) -> bytes:
    """What a template renders of an assistant's tool calls: names and arguments."""
    if not isinstance(tool_calls, list):
        return b""
    functions = (c.get("function") for c in tool_calls if isinstance(c, dict))
    return b"".join(
        f["name"].encode() + f["arguments"].encode()
        for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)
    )


def _completion_prompt(prompt: Any) -> tuple[list[bytes], bytes]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string or a list of strings")
    encoded = prompt.encode()
    return [encoded], encoded


def _optional_int(data: dict, field: str, minimum: int) -> int | None:
    value = data.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_request(f"{field} must be an integer >= {minimum}")
    return value


def _requested_max_tokens(data: dict, chat: bool) -> int:
    value = _optional_int(data, "max_completion_tokens", 1) if chat else None
    if value is None:
        value = _optional_int(data, "max_tokens", 1)
    return SIM_MAX_TOKENS_DEFAULT if value is None else value


def _context_error(max_model_len: int, prompt_tokens: int, max_tokens: int) -> HttpError:
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
        "completion). Please reduce the length of the messages or completion."
    )


def _stream_flags(data: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage), with vLLM's rules."""
    options = data.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.")
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object")
    include_usage = bool(options.get("include_usage"))
    return include_usage, include_usage and bool(options.get("continuous_usage_stats"))
