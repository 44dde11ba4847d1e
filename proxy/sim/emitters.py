"""How the simulated worker answers: an SSE stream a token per chunk, or one
JSON body once the answer is complete, both in vLLM's shapes.

Usage in streams follows vLLM: only with stream_options.include_usage, as a
last chunk with "choices": [] before [DONE]; with continuous_usage_stats as
well, every chunk carries the cumulative usage."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from proxy.sim.engine import Call, GenerationRequest

Send = Callable[[dict[str, Any]], Awaitable[None]]

SSE_PREFIX = b"data: "
SSE_SUFFIX = b"\n\n"
SSE_DONE = b"data: [DONE]\n\n"
TEMPLATE_MARK = "@@sim-token@@"
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


def usage(request: GenerationRequest, completion_tokens: int) -> dict[str, int]:
    k = request.usage_multiplier
    prompt_tokens = request.prompt_tokens * k
    completion_tokens *= k
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _stream_choice(chat: bool, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    return choice


class _Emitter:
    def __init__(self, request: GenerationRequest, send: Send, call: Call, base: dict[str, Any]) -> None:
        self.request = request
        self._send = send
        self._call = call
        self._base = base  # id, object, created, model: what every chunk or answer starts with


class StreamEmitter(_Emitter):
    """Writes one request's SSE chunks; token chunks reuse a pre-encoded template."""

    def __init__(self, request: GenerationRequest, send: Send, call: Call, base: dict[str, Any]) -> None:
        super().__init__(request, send, call, base)
        head, tail = self._encode(TEMPLATE_MARK, None, None, first=False).split(TEMPLATE_MARK.encode())
        self._token_head = head
        self._token_tail = tail

    def _encode(self, text: str, finish_reason: str | None, usage_now: dict | None, first: bool) -> bytes:
        chunk = dict(self._base)
        chunk["choices"] = [_stream_choice(self.request.chat, text, finish_reason, first)]
        if usage_now is not None:
            chunk["usage"] = usage_now
        return SSE_PREFIX + orjson.dumps(chunk) + SSE_SUFFIX

    async def _write(self, body: bytes) -> None:
        await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def start(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def token(self, index: int, word: str, word_json: bytes) -> None:
        request = self.request
        if index == 0 and request.chat:
            await self._write(self._encode("", None, self._running_usage(0), first=True))
        is_last = index + 1 == request.completion_tokens
        if is_last or request.continuous_usage:
            finish_reason = request.finish_reason if is_last else None
            await self._write(self._encode(word, finish_reason, self._running_usage(index + 1), first=False))
        else:
            await self._write(self._token_head + word_json + self._token_tail)

    def _running_usage(self, completion_tokens: int) -> dict | None:
        return usage(self.request, completion_tokens) if self.request.continuous_usage else None

    async def finish(self, completion_tokens: int, text: str) -> None:
        request = self.request
        tail = b""
        if completion_tokens == 0:  # nothing carried the finish_reason yet
            usage_now = self._running_usage(0)
            if request.chat:
                tail += self._encode("", None, usage_now, first=True)
            tail += self._encode("", request.finish_reason, usage_now, first=False)
        if request.include_usage:
            usage_chunk = dict(self._base, choices=[], usage=usage(request, completion_tokens))
            tail += SSE_PREFIX + orjson.dumps(usage_chunk) + SSE_SUFFIX
        self._call.finished = True  # completing the response wakes the disconnect watcher
        await self._send({"type": "http.response.body", "body": tail + SSE_DONE, "more_body": False})


class JsonEmitter(_Emitter):
    """Answers the whole completion in one JSON body once it is generated."""

    async def start(self) -> None:
        return None

    async def token(self, index: int, word: str, word_json: bytes) -> None:
        return None  # the text is rebuilt from the count, cheaper than collecting it

    async def finish(self, completion_tokens: int, text: str) -> None:
        request = self.request
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": request.finish_reason, "stop_reason": None}
        if request.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []}, **choice}
        else:
            choice = {"index": 0, "text": text, **choice, "prompt_logprobs": None}
        response = dict(self._base, choices=[choice], usage=usage(request, completion_tokens))
        if request.chat:
            response["prompt_logprobs"] = None
        self._call.finished = True
        await send_body(self._send, 200, orjson.dumps(response), JSON_HEADERS)


async def send_body(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    all_headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
