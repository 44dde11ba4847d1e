"""A simulated GPU worker that speaks vLLM's OpenAI-compatible HTTP API.

A plain ASGI3 callable (no framework) so that the worker costs little per
chunk and never becomes the bottleneck of a proxy benchmark.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not),
GET /v1/models, GET /health, GET /metrics (Prometheus text, vLLM's names).

Generated text: one pseudo-word per token, each with a leading space
(" lorem"), one token per SSE chunk, the same sequence for every request of a
worker built with the same seed.

prompt_tokens = max(1, sum over messages of (UTF-8 bytes of what the template
renders of it // 4 + 4)): its content, and an assistant's tool-call names and
arguments, as an engine's chat template renders them; the tools list counts as
one more message. A /v1/completions prompt counts as one message. It never
exceeds those bytes + 8 per message, so a proxy can bound it without a tokenizer.

Completion length: `max_completion_tokens` (chat) or `max_tokens`, else 16;
`min_tokens`, `ignore_eos` and other sampling fields are accepted and ignored.
prompt_tokens + max_tokens above the context length is vLLM's 400.

Request fields for tests that call the worker directly (vLLM ignores unknown
fields, so a client may always send them; the proxy forwards none of them):
- "sim_tokens": N                      stop after N tokens with finish_reason
                                       "stop" (N >= max_tokens gives "length";
                                       0 gives an empty completion)
- "sim_fail_before_first_token": true  HTTP 500, OpenAI-style error, nothing
                                       streamed
- "sim_fail_after_tokens": N           close the connection after N tokens,
                                       without [DONE] (streaming); a bare 500
                                       without a body shape when not streaming
- "sim_extra_tokens": N                generate N tokens past max_tokens (a worker
                                       that ignores the limit)
- "sim_inflate_usage": K               report prompt and completion tokens
                                       multiplied by K (a dishonest worker);
                                       overrides build_app(inflate_usage=...)

The same behaviours for every request, for tests that go through the proxy:
build_app(stop_after_tokens=N, fail_after_tokens=N, extra_tokens=N,
inflate_usage=K), or --stop-after-tokens, --fail-after-tokens, --extra-tokens,
--inflate-usage on the command line. They are plain attributes of the app, so a
test may change them between requests; a request's own field wins.

Usage in streams follows vLLM: only with stream_options.include_usage, as a
last chunk with "choices": [] before [DONE]; with continuous_usage_stats as
well, every chunk carries the cumulative usage.

Timing (see proxy/sim_profiles.py): requests beyond max_num_seqs wait; a
running request pays prefill for its uncached prompt tokens, then decodes at a
rate that depends on how many requests are running. Deadlines are absolute so
pacing does not drift. `time_scale` (or PARALON_SIM_TIME_SCALE) divides every
delay. A client disconnect stops generation at once and counts as an abort.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.sim.profiles import SimProfile, get_profile

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# vLLM's metric names and help; the counters count tokens, as vLLM's do.
METRICS = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
)

TIME_SCALE_ENV = "PARALON_SIM_TIME_SCALE"
DEFAULT_MAX_TOKENS = 16
PROMPT_BYTES_PER_TOKEN = 4
PROMPT_TOKENS_PER_MESSAGE = 4
MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# 64 bytes is about 16 tokens, vLLM's KV block size: only whole blocks are cached.
PREFIX_BLOCK_BYTES = 64
PREFIX_CACHE_MAX_BLOCKS = 65_536
# Unpaced streams would otherwise never give the event loop back while writing.
INSTANT_YIELD_EVERY_TOKENS = 8

WORDS = (
    "lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
    "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "enim",
    "ad", "minim", "veniam", "quis", "nostrud", "exercitation", "ullamco", "laboris", "nisi", "aliquip",
    "ex", "ea", "commodo", "consequat", "duis", "aute", "irure", "in", "reprehenderit", "voluptate",
    "velit", "esse", "cillum", "fugiat", "nulla", "pariatur", "excepteur", "sint", "occaecat", "cupidatat",
    "non", "proident", "sunt", "culpa", "qui", "officia", "deserunt", "mollit", "anim", "id", "est",
)  # fmt: skip
WORD_STEP = 37  # coprime with len(WORDS) (61), so the sequence visits every word

SSE_PREFIX = b"data: "
SSE_SUFFIX = b"\n\n"
SSE_DONE = b"data: [DONE]\n\n"
TEMPLATE_MARK = "@@sim-token@@"
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


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


class SimulatedCrash(Exception):
    """Raised to drop a stream mid-way, like a worker process dying."""


@dataclass(slots=True)
class GenerationRequest:
    chat: bool
    prompt_bytes: bytes  # the prompt as the prefix cache sees it
    prompt_tokens: int
    max_tokens: int
    completion_tokens: int
    finish_reason: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    fail_before_first_token: bool
    fail_after_tokens: int | None
    usage_multiplier: int


class SlotQueue:
    """At most max_running requests run; the rest wait in arrival order."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.running = 0
        self.waiting = 0
        self._waiters: deque[asyncio.Future] = deque()

    def try_acquire(self) -> bool:
        # Waiters exist only while all slots are taken, so this keeps FIFO order.
        if self.running < self.max_running:
            self.running += 1
            return True
        return False

    def enqueue(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        waiter = loop.create_future()
        self._waiters.append(waiter)
        return waiter

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # skip waiters whose client left
                waiter.set_result(True)  # the slot passes on; running is unchanged
                return
        self.running -= 1


class PrefixCache:
    """LRU of chained hashes of whole prompt blocks, like vLLM's block hashes."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def cached_bytes(self, data: bytes) -> int:
        chain_hash = 0
        for start in range(0, len(data) - PREFIX_BLOCK_BYTES + 1, PREFIX_BLOCK_BYTES):
            chain_hash = hash((chain_hash, data[start : start + PREFIX_BLOCK_BYTES]))
            if chain_hash not in self._blocks:
                return start
            self._blocks.move_to_end(chain_hash)
        return len(data) - len(data) % PREFIX_BLOCK_BYTES

    def insert(self, data: bytes) -> None:
        chain_hash = 0
        for start in range(0, len(data) - PREFIX_BLOCK_BYTES + 1, PREFIX_BLOCK_BYTES):
            chain_hash = hash((chain_hash, data[start : start + PREFIX_BLOCK_BYTES]))
            self._blocks[chain_hash] = None
            self._blocks.move_to_end(chain_hash)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


class SimWorkerState:
    """Counters a test or the /metrics endpoint reads."""

    def __init__(self, max_running: int) -> None:
        self.slots = SlotQueue(max_running)
        self.requests_started = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.requests_failed = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0
        self.kv_tokens_in_use = 0

    @property
    def requests_running(self) -> int:
        return self.slots.running

    @property
    def requests_waiting(self) -> int:
        return self.slots.waiting


class Call:
    """One generation request's link to its client: disconnect and waits."""

    __slots__ = ("_waiter", "disconnected", "finished", "loop", "tokens_generated")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.disconnected = False
        self.finished = False
        self.tokens_generated = 0
        self._waiter: asyncio.Future | None = None

    def on_disconnect(self) -> None:
        if self.finished:
            return
        self.disconnected = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)

    async def wait(self, waiter: asyncio.Future) -> bool:
        """The waiter's result, or False as soon as the client leaves."""
        self._waiter = waiter
        try:
            return await waiter
        finally:
            self._waiter = None

    async def sleep_until(self, deadline: float) -> bool:
        if self.disconnected:
            return False
        if deadline <= self.loop.time():
            return True
        waiter = self.loop.create_future()
        timer = self.loop.call_at(deadline, _resolve, waiter, True)
        try:
            return await self.wait(waiter)
        finally:
            timer.cancel()


def _resolve(waiter: asyncio.Future, value: bool) -> None:
    if not waiter.done():
        waiter.set_result(value)


async def _watch_disconnect(receive: Receive, call: Call) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            call.on_disconnect()
            return


# --- request parsing ---------------------------------------------------------


def count_prompt_tokens(contents: list[bytes]) -> int:
    tokens = sum(len(c) // PROMPT_BYTES_PER_TOKEN + PROMPT_TOKENS_PER_MESSAGE for c in contents)
    return max(1, tokens)


def _bad_request(message: str) -> HttpError:
    return HttpError(400, "BadRequestError", message)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise _bad_request("message content must be a string or a list of parts")


def _chat_prompt(messages: Any) -> tuple[list[bytes], bytes]:
    """Per-message contents, and the whole conversation as cache bytes."""
    if not isinstance(messages, list) or not messages:
        raise _bad_request("messages must be a non-empty list")
    contents: list[bytes] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad_request("each message needs a role")
        contents.append(_content_text(message.get("content")).encode() + _tool_calls_text(message.get("tool_calls")))
    roles = [m["role"].encode() for m in messages]
    return contents, b"".join(_chat_cache_bytes(r, c) for r, c in zip(roles, contents, strict=True))


def _tool_calls_text(tool_calls: Any) -> bytes:
    """What a template renders of an assistant's tool calls: names and arguments."""
    if not isinstance(tool_calls, list):
        return b""
    functions = (c.get("function") for c in tool_calls if isinstance(c, dict))
    return b"".join(
        f["name"].encode() + f["arguments"].encode()
        for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)
    )


def _chat_cache_bytes(role: bytes, content: bytes) -> bytes:
    return role + b"\x00" + content + b"\x00"


def _completion_prompt(prompt: Any) -> tuple[list[bytes], bytes]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad_request("prompt must be a string or a list of strings")
    encoded = prompt.encode()
    return [encoded], encoded


def _optional_int(data: dict, field: str, minimum: int) -> int | None:
    value = data.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad_request(f"{field} must be an integer >= {minimum}")
    return value


def _requested_max_tokens(data: dict, chat: bool) -> int:
    value = _optional_int(data, "max_completion_tokens", 1) if chat else None
    if value is None:
        value = _optional_int(data, "max_tokens", 1)
    return DEFAULT_MAX_TOKENS if value is None else value


def _context_error(max_model_len: int, prompt_tokens: int, max_tokens: int) -> HttpError:
    return _bad_request(
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
        raise _bad_request("Stream options can only be defined when `stream=True`.")
    if not isinstance(options, dict):
        raise _bad_request("stream_options must be an object")
    include_usage = bool(options.get("include_usage"))
    return include_usage, include_usage and bool(options.get("continuous_usage_stats"))


# --- response encoding -------------------------------------------------------


def _usage(request: GenerationRequest, completion_tokens: int) -> dict[str, int]:
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


class StreamEmitter:
    """Writes one request's SSE chunks; token chunks reuse a pre-encoded template."""

    def __init__(self, request: GenerationRequest, send: Send, call: Call, base: dict[str, Any]) -> None:
        self.request = request
        self._send = send
        self._call = call
        self._base = base
        head, tail = self._encode(TEMPLATE_MARK, None, None, first=False).split(TEMPLATE_MARK.encode())
        self._token_head = head
        self._token_tail = tail

    def _encode(self, text: str, finish_reason: str | None, usage: dict | None, first: bool) -> bytes:
        chunk = dict(self._base)
        chunk["choices"] = [_stream_choice(self.request.chat, text, finish_reason, first)]
        if usage is not None:
            chunk["usage"] = usage
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
        return _usage(self.request, completion_tokens) if self.request.continuous_usage else None

    async def finish(self, completion_tokens: int, text: str) -> None:
        request = self.request
        tail = b""
        if completion_tokens == 0:  # nothing carried the finish_reason yet
            usage = self._running_usage(0)
            if request.chat:
                tail += self._encode("", None, usage, first=True)
            tail += self._encode("", request.finish_reason, usage, first=False)
        if request.include_usage:
            usage_chunk = dict(self._base, choices=[], usage=_usage(request, completion_tokens))
            tail += SSE_PREFIX + orjson.dumps(usage_chunk) + SSE_SUFFIX
        self._call.finished = True  # completing the response wakes the disconnect watcher
        await self._send({"type": "http.response.body", "body": tail + SSE_DONE, "more_body": False})


class JsonEmitter:
    """Answers the whole completion in one JSON body once it is generated."""

    def __init__(self, request: GenerationRequest, send: Send, call: Call, base: dict[str, Any]) -> None:
        self.request = request
        self._send = send
        self._call = call
        self._base = base

    async def start(self) -> None:
        return None

    async def token(self, index: int, word: str, word_json: bytes) -> None:
        return None  # the text is rebuilt from the count, cheaper than collecting it

    async def finish(self, completion_tokens: int, text: str) -> None:
        request = self.request
        if request.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": request.finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": request.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        response = dict(self._base, choices=[choice], usage=_usage(request, completion_tokens))
        if request.chat:
            response["prompt_logprobs"] = None
        self._call.finished = True
        await _send_body(self._send, 200, orjson.dumps(response), JSON_HEADERS)


async def _send_body(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    all_headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send: Send, error: HttpError) -> None:
    await _send_body(send, error.status, error.body(), JSON_HEADERS)


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size_bytes = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client left before sending its request")
        body = message.get("body", b"")
        size_bytes += len(body)
        if size_bytes > MAX_REQUEST_BODY_BYTES:
            raise HttpError(413, "BadRequestError", f"request body above {MAX_REQUEST_BODY_BYTES} bytes")
        parts.append(body)
        if not message.get("more_body", False):
            return b"".join(parts)


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _metric(name: str, kind: str, help_text: str, labels: str, value: float) -> str:
    sample = f"{name}_total" if kind == "counter" else name
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{sample}{{{labels}}} {float(value)!r}\n"


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# --- the application ---------------------------------------------------------


class SimWorker:
    """The ASGI3 application; `state` holds the counters."""

    def __init__(
        self,
        profile: SimProfile,
        model: str,
        *,
        seed: int,
        max_model_len: int | None,
        inflate_usage: int,
        time_scale: float,
        stop_after_tokens: int | None = None,
        fail_after_tokens: int | None = None,
        extra_tokens: int = 0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if inflate_usage < 1:
            raise ValueError("inflate_usage must be at least 1")
        self.profile = profile
        self.model = model
        self.max_model_len = max_model_len or profile.max_model_len_tokens
        self.inflate_usage = inflate_usage
        self.stop_after_tokens = stop_after_tokens
        self.fail_after_tokens = fail_after_tokens
        self.extra_tokens = extra_tokens
        self.time_scale = time_scale
        self.state = SimWorkerState(profile.max_num_seqs)
        self.created = int(time.time())
        self._prefix_cache = PrefixCache(min(PREFIX_CACHE_MAX_BLOCKS, profile.kv_cache_capacity_tokens // 16))
        self._words = [" " + WORDS[(seed + i * WORD_STEP) % len(WORDS)] for i in range(len(WORDS))]
        self._words_json = [orjson.dumps(w)[1:-1] for w in self._words]
        self._token_interval_s = self._decode_intervals_s()
        self._routes: dict[str, tuple[str, Callable[[Scope, Receive, Send], Awaitable[None]]]] = {
            "/v1/chat/completions": ("POST", self._chat_completions),
            "/v1/completions": ("POST", self._completions),
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
        }

    def _decode_intervals_s(self) -> list[float]:
        """Seconds per token for each number of running requests (index)."""
        if not self.profile.paced:
            return []
        rates = (self.profile.per_request_tok_s(n) for n in range(self.profile.max_num_seqs + 1))
        return [1.0 / (rate * self.time_scale) for rate in rates]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._route(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes.get(scope["path"])
        if route is None:
            await _send_body(send, 404, b'{"detail":"Not Found"}', JSON_HEADERS)
            return
        method, handler = route
        if scope["method"] != method:
            await _send_body(send, 405, b'{"detail":"Method Not Allowed"}', JSON_HEADERS)
            return
        await handler(scope, receive, send)

    # --- simple endpoints ---

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_body(send, 200, b"", [])

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        await _send_body(send, 200, orjson.dumps({"object": "list", "data": [card]}), JSON_HEADERS)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_body(send, 200, self.metrics_text().encode(), [(b"content-type", b"text/plain; version=0.0.4")])

    def metrics_text(self) -> str:
        s = self.state
        labels = f'model_name="{_label_value(self.model)}"'
        kv_usage = min(1.0, s.kv_tokens_in_use / self.profile.kv_cache_capacity_tokens)
        values = (
            s.requests_running,
            s.requests_waiting,
            kv_usage,
            s.prefix_cache_queries_tokens,
            s.prefix_cache_hits_tokens,
            s.prompt_tokens_total,
            s.generation_tokens_total,
        )
        return "".join(
            _metric(name, kind, help_text, labels, value)
            for (name, kind, help_text), value in zip(METRICS, values, strict=True)
        )

    # --- generation ---

    async def _chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generation_endpoint(receive, send, chat=True)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generation_endpoint(receive, send, chat=False)

    async def _generation_endpoint(self, receive: Receive, send: Send, chat: bool) -> None:
        try:
            request = self.parse_request(await _read_body(receive), chat)
        except HttpError as error:
            await _send_error(send, error)
            return
        except ConnectionResetError:
            return
        if request.fail_before_first_token:
            self.state.requests_failed += 1
            await _send_error(send, HttpError(500, "InternalServerError", "Simulated failure before the first token."))
            return
        await self._run_generation(request, receive, send)

    def parse_request(self, body: bytes, chat: bool) -> GenerationRequest:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise _bad_request("the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise _bad_request("the request body must be a JSON object")
        model = data.get("model") or self.model
        if model != self.model:
            raise HttpError(404, "NotFoundError", f"The model `{model}` does not exist.")
        contents, prompt_bytes = _chat_prompt(data.get("messages")) if chat else _completion_prompt(data.get("prompt"))
        if chat and data.get("tools"):
            contents.append(orjson.dumps(data["tools"]))
        prompt_tokens = count_prompt_tokens(contents)
        max_tokens = _requested_max_tokens(data, chat)
        if prompt_tokens + max_tokens > self.max_model_len:
            raise _context_error(self.max_model_len, prompt_tokens, max_tokens)
        sim_tokens = _optional_int(data, "sim_tokens", 0)
        if sim_tokens is None:
            sim_tokens = self.stop_after_tokens
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
            completion_tokens=sim_tokens if stops_early else max_tokens + (self.extra_tokens if extra_tokens is None else extra_tokens),
            finish_reason="stop" if stops_early else "length",
            stream=stream,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            fail_before_first_token=bool(data.get("sim_fail_before_first_token")),
            fail_after_tokens=self.fail_after_tokens if fail_after_tokens is None else fail_after_tokens,
            usage_multiplier=_optional_int(data, "sim_inflate_usage", 1) or self.inflate_usage,
        )

    def _response_base(self, chat: bool) -> dict[str, Any]:
        if chat:
            id_, object_ = f"chatcmpl-{uuid.uuid4().hex}", "chat.completion.chunk"
        else:
            id_, object_ = f"cmpl-{uuid.uuid4().hex}", "text_completion"
        return {"id": id_, "object": object_, "created": int(time.time()), "model": self.model}

    async def _run_generation(self, request: GenerationRequest, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        call = Call(loop)
        base = self._response_base(request.chat)
        if request.stream:
            emitter: StreamEmitter | JsonEmitter = StreamEmitter(request, send, call, base)
        else:
            base["object"] = "chat.completion" if request.chat else "text_completion"
            emitter = JsonEmitter(request, send, call, base)
        self.state.requests_started += 1
        watcher = loop.create_task(_watch_disconnect(receive, call))
        try:
            await emitter.start()
            await self._generate(request, call, emitter)
        except SimulatedCrash:
            # Returning without completing the response makes the server drop the connection.
            self.state.requests_failed += 1
            return
        finally:
            call.finished = True
            watcher.cancel()
        if call.disconnected:
            self.state.requests_aborted += 1
        else:
            self.state.requests_finished += 1

    async def _generate(self, request: GenerationRequest, call: Call, emitter: StreamEmitter | JsonEmitter) -> None:
        slots = self.state.slots
        if not slots.try_acquire() and not await self._wait_for_slot(call):
            return
        self.state.kv_tokens_in_use += request.prompt_tokens
        try:
            await self._decode(request, call, emitter)
        finally:
            generated = call.tokens_generated
            self.state.kv_tokens_in_use -= request.prompt_tokens + generated
            slots.release()
            self._prefix_cache.insert(request.prompt_bytes + self._output_cache_bytes(request, generated))
        if not call.disconnected:
            await emitter.finish(generated, self.text_of(generated))

    async def _wait_for_slot(self, call: Call) -> bool:
        slots = self.state.slots
        waiter = slots.enqueue(call.loop)
        slots.waiting += 1
        granted = False
        try:
            granted = await call.wait(waiter)
        finally:
            slots.waiting -= 1
            holds_slot = waiter.done() and not waiter.cancelled() and waiter.result() is True
            if holds_slot and (call.disconnected or not granted):
                slots.release()  # handed a slot just as the client left
        return granted and not call.disconnected

    def _prefill_s(self, request: GenerationRequest) -> float:
        """Charges the prefix cache and returns the time to prefill what is not cached."""
        cached_bytes = self._prefix_cache.cached_bytes(request.prompt_bytes)
        prompt_tokens = request.prompt_tokens
        # vLLM always recomputes the last prompt token.
        cached_tokens = min(prompt_tokens - 1, prompt_tokens * cached_bytes // max(1, len(request.prompt_bytes)))
        self.state.prefix_cache_queries_tokens += prompt_tokens
        self.state.prefix_cache_hits_tokens += cached_tokens
        self.state.prompt_tokens_total += prompt_tokens
        if not self.profile.paced:
            return 0.0
        return (prompt_tokens - cached_tokens) / (self.profile.prefill_tok_s * self.time_scale)

    async def _decode(self, request: GenerationRequest, call: Call, emitter: StreamEmitter | JsonEmitter) -> None:
        """Emits tokens on schedule, counting them in call.tokens_generated."""
        paced = self.profile.paced
        deadline = call.loop.time() + self._prefill_s(request)
        if paced and not await call.sleep_until(deadline):
            return
        self._prefix_cache.insert(request.prompt_bytes)
        words, words_json, word_count = self._words, self._words_json, len(self._words)
        intervals_s, slots, state = self._token_interval_s, self.state.slots, self.state
        for index in range(request.completion_tokens):
            if paced:
                deadline += intervals_s[slots.running]
                if not await call.sleep_until(deadline):
                    return
            elif index % INSTANT_YIELD_EVERY_TOKENS == INSTANT_YIELD_EVERY_TOKENS - 1:
                await asyncio.sleep(0)
            if call.disconnected:
                return
            if index == request.fail_after_tokens:
                raise SimulatedCrash
            call.tokens_generated += 1
            state.generation_tokens_total += 1
            state.kv_tokens_in_use += 1
            await emitter.token(index, words[index % word_count], words_json[index % word_count])
        if request.fail_after_tokens is not None:
            raise SimulatedCrash  # asked to fail after more tokens than the answer has

    def text_of(self, completion_tokens: int) -> str:
        words, word_count = self._words, len(self._words)
        return "".join(words[i % word_count] for i in range(completion_tokens))

    def _output_cache_bytes(self, request: GenerationRequest, completion_tokens: int) -> bytes:
        """What a follow-up repeats of this answer, so the answer is cached too."""
        text = self.text_of(completion_tokens).encode()
        return _chat_cache_bytes(b"assistant", text) if request.chat else text


def _time_scale_from_env() -> float:
    return float(os.environ.get(TIME_SCALE_ENV, "1") or "1")


def build_app(
    profile: str = "instant",
    model: str = "paralon-demo",
    *,
    seed: int = 0,
    max_model_len: int | None = None,
    inflate_usage: int = 1,
    time_scale: float | None = None,
    stop_after_tokens: int | None = None,
    fail_after_tokens: int | None = None,
    extra_tokens: int = 0,
) -> SimWorker:
    """An ASGI3 app; time_scale defaults to $PARALON_SIM_TIME_SCALE, else 1.
    stop_after_tokens, fail_after_tokens, extra_tokens and inflate_usage apply
    to every request, as the sim_* request fields do to one."""
    return SimWorker(
        get_profile(profile),
        model,
        seed=seed,
        max_model_len=max_model_len,
        inflate_usage=inflate_usage,
        time_scale=_time_scale_from_env() if time_scale is None else time_scale,
        stop_after_tokens=stop_after_tokens,
        fail_after_tokens=fail_after_tokens,
        extra_tokens=extra_tokens,
    )


def _event_loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def serve(host: str, port: int, profile: str, model: str, max_model_len: int | None = None, **behaviour) -> None:
    """Serves a simulated worker until interrupted; `behaviour` as build_app takes it."""
    import uvicorn

    uvicorn.run(
        build_app(profile, model, max_model_len=max_model_len, **behaviour),
        host=host,
        port=port,
        http="httptools",
        loop=_event_loop_name(),
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Simulated vLLM worker")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--profile", default="instant")
    parser.add_argument("--model", default="paralon-demo")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--inflate-usage", type=int, default=1, help="report usage multiplied by K (a dishonest worker)")
    parser.add_argument("--stop-after-tokens", type=int, default=None, help="stop every answer after N tokens")
    parser.add_argument("--fail-after-tokens", type=int, default=None, help="drop every stream after N tokens")
    parser.add_argument("--extra-tokens", type=int, default=0, help="generate N tokens past max_tokens")
    args = parser.parse_args(argv)
    serve(args.host, args.port, args.profile, args.model, args.max_model_len, inflate_usage=args.inflate_usage,
          stop_after_tokens=args.stop_after_tokens, fail_after_tokens=args.fail_after_tokens,
          extra_tokens=args.extra_tokens)


if __name__ == "__main__":
    main()
