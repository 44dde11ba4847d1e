"""A hand-written OpenAI/vLLM-compatible worker whose owner may be dishonest.

A plain ASGI3 app (served by uvicorn in a thread of the test process, see
`start_hostile_worker`) that streams chat completions the way vLLM does, one
token per chunk, with the cumulative usage on every chunk (vLLM's
`continuous_usage_stats`) and a last usage chunk before [DONE]. Its behaviour
is chosen when it starts (`BEHAVIOURS`); every request body it receives is
recorded with the usage it last reported, so a test can check both what was
forwarded to it and what it claimed.

An honest answer: a tool call when the request offers `tools` and the last
message is not a tool reply; reasoning before the text when the last user
message asks to "think"; otherwise `WORDS_PER_ANSWER` words. Its prompt count
is UTF-8 bytes // 4 plus 4 per message over everything the engine would see
(contents, tool calls, tool replies, tool definitions, schemas): a count any
byte-level tokenizer could produce, never above the bytes.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy import metering
from proxy.limits import SIM_PROMPT_BYTES_PER_TOKEN, SIM_PROMPT_TOKENS_PER_MESSAGE  # the simulated worker's prompt model
from tests.support.harness import MODEL, ThreadedServer

HONEST = "honest"
SPLIT_CHOICES = "split_choices"  # each word as 10 choices, all index 0, in one chunk
TOOL_CALL_PADDING = "tool_call_padding"  # 9 extra chunks per word with delta.tool_calls: [{}]
REASONING_PADDING = "reasoning_padding"  # 9 extra chunks per word with reasoning_content: " "
EMPTY_PADDING = "empty_padding"  # 9 extra chunks per word with empty content
REPEATS = "repeats"  # every word's chunk sent 10 times, each reported as a token
DUPLICATE_CHOICES = "duplicate_choices"  # every choice sent twice with index 0
INFLATE_COMPLETION = "inflate_completion"  # completion reported x INFLATION_FACTOR
INFLATE_PROMPT = "inflate_prompt"  # prompt reported x INFLATION_FACTOR
INFLATE_BOTH = "inflate_both"
INFLATE_WITHOUT_FINISH = "inflate_without_finish"  # completion inflated, no finish_reason ever, then [DONE]
PROMPT_AT_BOUND = "prompt_at_bound"  # prompt reported at exactly the proxy's public upper bound
DIES_MID_STREAM = "dies_mid_stream"  # honest usage, connection closed without [DONE] after DIE_AFTER_WORDS
BEHAVIOURS = (HONEST, SPLIT_CHOICES, TOOL_CALL_PADDING, REASONING_PADDING, EMPTY_PADDING, REPEATS, DUPLICATE_CHOICES,
              INFLATE_COMPLETION, INFLATE_PROMPT, INFLATE_BOTH, INFLATE_WITHOUT_FINISH, PROMPT_AT_BOUND, DIES_MID_STREAM)

WORDS_PER_ANSWER = 20
PIECES_PER_WORD = 10  # for the chunk-splitting behaviours: 1 real token, 10 reported
INFLATION_FACTOR = 10
DIE_AFTER_WORDS = 7
CONTEXT_LENGTH_TOKENS = 32_768
REQUEST_BODY_BYTES_MAX = 8 * 1024 * 1024
REASONING_WORDS = 6
TOOL_ARGUMENT_PIECES = 6
# Short words for most behaviours; words of at least PIECES_PER_WORD bytes for
# SPLIT_CHOICES, so that each of its pieces carries text.
WORDS = (" the", " cat", " sat", " on", " a", " warm", " mat", " and", " slept", " well")
LONG_WORDS = (" consectetur", " exercitation", " reprehenderit", " voluptatibus", " adipiscingly")
THINK_MARK = "think"

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


@dataclass
class ReceivedRequest:
    """One request body as the worker received it, and what it reported."""

    body: dict
    reported_prompt_tokens: int = 0
    reported_completion_tokens: int = 0
    honest_completion_tokens: int = 0  # what it really generated (one per word or tool-call piece)
    honest_prompt_tokens: int = 0
    finished: bool = False

    @property
    def last_user_text(self) -> str:
        for message in reversed(self.body.get("messages") or []):
            if message.get("role") == "user":
                return content_text(message.get("content"))
        return ""


@dataclass
class HostileWorker:
    """The ASGI3 app. `received` lists every generation request, in order."""

    behaviour: str = HONEST
    model: str = MODEL
    die_after_words: int = DIE_AFTER_WORDS
    received: list[ReceivedRequest] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.behaviour not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour {self.behaviour!r}; one of {', '.join(BEHAVIOURS)}")

    def record_for(self, marker: str) -> ReceivedRequest:
        """The request whose last user message contains `(marker)`."""
        found = [r for r in self.received if f"({marker})" in r.last_user_text]
        if len(found) != 1:
            raise LookupError(f"{len(found)} requests carry {marker!r}")
        return found[0]

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            await _send_body(send, 200, b"", [])
        elif path == "/v1/models" and method == "GET":
            card = {"id": self.model, "object": "model", "created": 0, "owned_by": "hostile",
                    "max_model_len": CONTEXT_LENGTH_TOKENS}
            await _send_body(send, 200, orjson.dumps({"object": "list", "data": [card]}), JSON_HEADERS)
        elif path == "/metrics" and method == "GET":
            running = sum(1 for r in self.received if not r.finished)
            text = f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n"
            await _send_body(send, 200, text.encode(), [(b"content-type", b"text/plain; version=0.0.4")])
        elif path == "/v1/chat/completions" and method == "POST":
            await self._chat(receive, send)
        else:
            await _send_body(send, 404, b'{"detail":"Not Found"}', JSON_HEADERS)

    async def _chat(self, receive, send) -> None:
        body = orjson.loads(await _read_body(receive))
        record = ReceivedRequest(body)
        record.honest_prompt_tokens = honest_prompt_tokens(body)
        with self._lock:
            self.received.append(record)
        try:
            if body.get("stream") is True:
                await self._stream(record, send)
            else:
                await self._answer_whole(record, send)
        finally:
            record.finished = True

    # What is generated, as (kind, text) tokens: kind is content, reasoning, tool_name or tool_arguments
    def honest_tokens(self, record: ReceivedRequest) -> list[tuple[str, str]]:
        body = record.body
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or WORDS_PER_ANSWER
        messages = body.get("messages") or []
        last_role = messages[-1].get("role") if messages else "user"
        tokens: list[tuple[str, str]] = []
        if body.get("tools") and last_role != "tool":
            name = body["tools"][0]["function"]["name"]
            arguments = orjson.dumps({"query": "warm mats", "limit": 3}).decode()
            step = -(-len(arguments) // TOOL_ARGUMENT_PIECES)
            tokens.append(("tool_name", name))
            tokens += [("tool_arguments", arguments[i : i + step]) for i in range(0, len(arguments), step)]
        else:
            if THINK_MARK in record.last_user_text:
                tokens += [("reasoning", WORDS[i % len(WORDS)]) for i in range(REASONING_WORDS)]
            words = LONG_WORDS if self.behaviour == SPLIT_CHOICES else WORDS
            tokens += [("content", words[i % len(words)]) for i in range(WORDS_PER_ANSWER)]
        return tokens[:limit]

    def reported_usage(self, record: ReceivedRequest, honest_completion: int, padded_completion: int) -> dict:
        prompt, completion = record.honest_prompt_tokens, padded_completion
        if self.behaviour in (INFLATE_PROMPT, INFLATE_BOTH):
            prompt *= INFLATION_FACTOR
        if self.behaviour in (INFLATE_COMPLETION, INFLATE_BOTH, INFLATE_WITHOUT_FINISH):
            completion = honest_completion * INFLATION_FACTOR
        if self.behaviour == PROMPT_AT_BOUND:
            prompt = proxy_public_prompt_bound(record.body)
        record.reported_prompt_tokens, record.reported_completion_tokens = prompt, completion
        record.honest_completion_tokens = honest_completion
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunks_for(self, kind: str, text: str, tool_call_id: str) -> list[list[dict]]:
        """The choices lists of the chunks that carry one honest token, as this behaviour sends them."""
        delta = _delta(kind, text, tool_call_id)
        honest = [[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]]
        behaviour = self.behaviour
        if behaviour == SPLIT_CHOICES and kind == "content":
            cuts = [len(text) * i // PIECES_PER_WORD for i in range(PIECES_PER_WORD + 1)]
            pieces = [text[start:end] for start, end in zip(cuts, cuts[1:])]
            return [[{"index": 0, "delta": {"content": p}, "logprobs": None, "finish_reason": None} for p in pieces]]
        if behaviour == DUPLICATE_CHOICES:
            return [honest[0] * 2]
        if behaviour == REPEATS:
            return honest * PIECES_PER_WORD
        padding = {TOOL_CALL_PADDING: {"tool_calls": [{}]}, REASONING_PADDING: {"reasoning_content": " "},
                   EMPTY_PADDING: {"content": ""}}.get(behaviour)
        if padding is not None:
            return honest + [[{"index": 0, "delta": padding, "logprobs": None, "finish_reason": None}]] * (PIECES_PER_WORD - 1)
        return honest

    async def _stream(self, record: ReceivedRequest, send) -> None:
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": record.body.get("model", self.model)}
        tool_call_id = f"call_{uuid.uuid4().hex[:12]}"
        tokens = self.honest_tokens(record)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}], "usage": self.reported_usage(record, 0, 0)}
        await _write(send, _sse(first))
        honest_count = padded_count = 0
        for kind, text in tokens:
            if self.behaviour == DIES_MID_STREAM and honest_count == self.die_after_words:
                return  # no [DONE], no end of the chunked body: uvicorn drops the connection
            honest_count += 1
            for choices in self.chunks_for(kind, text, tool_call_id):
                padded_count += len(choices)
                usage = self.reported_usage(record, honest_count, padded_count)
                await _write(send, _sse({**base, "choices": choices, "usage": usage}))
            await asyncio.sleep(0)
        finish_reason = "tool_calls" if tokens and tokens[0][0] == "tool_name" else "stop"
        if self.behaviour == INFLATE_WITHOUT_FINISH:  # as if the answer never ended, to dodge the proof
            finish_reason = None
        usage = self.reported_usage(record, honest_count, padded_count)
        last = {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}],
                "usage": usage}
        tail = _sse(last) + _sse({**base, "choices": [], "usage": usage}) + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _answer_whole(self, record: ReceivedRequest, send) -> None:
        tokens = self.honest_tokens(record)
        content = "".join(text for kind, text in tokens if kind == "content")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tokens and tokens[0][0] == "tool_name":
            arguments = "".join(text for kind, text in tokens if kind == "tool_arguments")
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                      "function": {"name": tokens[0][1], "arguments": arguments}}]
        answer = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                  "model": record.body.get("model", self.model),
                  "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
                  "usage": self.reported_usage(record, len(tokens), len(tokens))}
        await _send_body(send, 200, orjson.dumps(answer), JSON_HEADERS)


def _delta(kind: str, text: str, tool_call_id: str) -> dict:
    if kind == "content":
        return {"content": text}
    if kind == "reasoning":
        return {"reasoning_content": text}
    if kind == "tool_name":
        return {"tool_calls": [{"index": 0, "id": tool_call_id, "type": "function",
                                "function": {"name": text, "arguments": ""}}]}
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


def content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def engine_visible_bytes(body: dict) -> list[int]:
    """UTF-8 bytes per message of everything a chat template renders, then the request's tools and schema."""
    sizes = []
    for message in body.get("messages") or []:
        size = len(content_text(message.get("content")).encode())
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            size += len((function.get("name") or "").encode()) + len((function.get("arguments") or "").encode())
        for name in ("tool_call_id", "name"):
            if isinstance(message.get(name), str):
                size += len(message[name].encode())
        sizes.append(size)
    extras = sum(len(orjson.dumps(body[name])) for name in ("tools", "response_format") if body.get(name) is not None)
    return sizes + [extras]


def honest_prompt_tokens(body: dict) -> int:
    sizes = engine_visible_bytes(body)
    return max(1, sum(size // SIM_PROMPT_BYTES_PER_TOKEN for size in sizes) + SIM_PROMPT_TOKENS_PER_MESSAGE * (len(sizes) - 1))


def proxy_public_prompt_bound(body: dict) -> int:
    """The proxy's published upper bound for this prompt (what a dishonest
    owner reads in the open source and reports exactly)."""
    return metering.prompt_tokens_bound("chat", body)


def _sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _write(send, body: bytes) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _send_body(send, status: int, body: bytes, headers: list) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > REQUEST_BODY_BYTES_MAX:
            raise ValueError("request body too large")
        if not message.get("more_body"):
            return b"".join(chunks)


def start_hostile_worker(behaviour: str, **options) -> ThreadedServer:
    """A started server; `server.app` is the HostileWorker. Stop it with `server.stop()`."""
    return ThreadedServer(HostileWorker(behaviour, **options)).start()
