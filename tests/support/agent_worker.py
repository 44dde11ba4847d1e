"""A test worker that answers the way agent workloads need: vLLM's OpenAI API,
honestly, with tool calls, structured output, reasoning, logprobs, refusals,
n > 1 and lists of prompts. A plain ASGI3 app; `start_agent_worker()` serves it
with tests/support/harness.ThreadedServer. Every request body it receives is
kept in `received`, with the usage it reported.

Routes: POST /v1/chat/completions and /v1/completions (streaming or not),
GET /v1/models, GET /health, GET /metrics (vLLM's two gauges).

What it answers, chat:
- a tool call when `tools` are offered, `tool_choice` is not "none" and the
  last message is not a tool reply: the named function of `tool_choice`, else
  the first tool (every tool with the marker "(parallel)"). Arguments are a
  JSON object generated from the function's `parameters` schema; a stream
  sends the id and name first, then the arguments in TOOL_ARGUMENT_PIECES
  pieces; finish_reason "tool_calls".
- a JSON object generated from the schema when `response_format` is
  `json_schema` (every property, so the required ones too), `{"answer": ...}`
  for `json_object`, in pieces of STRUCTURED_PIECE_CHARS characters.
- otherwise ANSWER_WORDS words (choice k starts at word k, so choices differ).
Markers in the last user message (chat) or the prompt (completions):
- "(think)": REASONING_WORDS words of `reasoning_content` first.
- "(refuse)": the answer is a `refusal` (REFUSAL_TEXT, word by word) and content is null.
Logprobs: chat `logprobs: true` gives `logprobs.content` entries (token,
logprob, bytes, `top_logprobs` as many as asked) for content tokens;
completions `logprobs: N` gives tokens, token_logprobs, top_logprobs (N
entries each) and text_offset (from the start of the choice's text).

`n` choices per prompt; a completions `prompt` may be a string, a list of
strings, a list of token ids or a list of token-id lists. Choice index =
prompt_index * n + j, as vLLM numbers them. Each token is its own stream chunk
of one choice; choices are interleaved, then each gets its finish chunk.

Usage, honest: one completion token per generated piece (each is at least one
UTF-8 byte, so the proxy's byte bound always holds); prompt tokens are UTF-8
bytes // SIM_PROMPT_BYTES_PER_TOKEN plus SIM_PROMPT_TOKENS_PER_MESSAGE per
message (chat), bytes // 4 per string prompt and one per token id, counted
once per prompt whatever `n`. Streams with `continuous_usage_stats` carry,
as vLLM's do, the usage of the chunk's own choice (its prompt, its tokens so
far); the final usage chunk carries the total.

Dishonest variants for tests (attributes, set at start or between requests):
`out_of_range_choice` sends, once per stream, an extra chunk whose choice has
the index n * prompts, its tokens reported; `duplicate_choices` sends every
token chunk with its choice twice, both reported.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field

import orjson

from proxy.limits import SIM_PROMPT_BYTES_PER_TOKEN, SIM_PROMPT_TOKENS_PER_MESSAGE
from tests.support.harness import MODEL, ThreadedServer
from tests.support.hostile_worker import content_text, honest_prompt_tokens

ANSWER_WORDS = 12
REASONING_WORDS = 5
TOOL_ARGUMENT_PIECES = 5
STRUCTURED_PIECE_CHARS = 6
CONTEXT_LENGTH_TOKENS = 32_768
REQUEST_BODY_BYTES_MAX = 8 * 1024 * 1024
WORDS = (" the", " agent", " reads", " a", " warm", " map", " and", " finds", " its", " way", " home", " again")
REFUSAL_TEXT = " I cannot help with that request."
TOP_LOGPROB_STEP = 0.5  # each alternative is this much less likely than the one before
THINK, REFUSE, PARALLEL = "(think)", "(refuse)", "(parallel)"

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


@dataclass
class Piece:
    """One generated token: what it is (content, reasoning, refusal, tool_name, tool_arguments) and its text."""
    kind: str
    text: str
    call: int = 0  # the tool call it belongs to
    call_id: str = ""


@dataclass
class Received:
    body: dict
    prompt_tokens: int = 0
    completion_tokens: int = 0  # what it really generated, over all choices
    finished: bool = False


@dataclass
class AgentWorker:
    model: str = MODEL
    out_of_range_choice: bool = False
    duplicate_choices: bool = False
    received: list[Received] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            await _send_body(send, 200, b"", [])
        elif path == "/v1/models" and method == "GET":
            card = {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm",
                    "max_model_len": CONTEXT_LENGTH_TOKENS}
            await _send_body(send, 200, orjson.dumps({"object": "list", "data": [card]}), JSON_HEADERS)
        elif path == "/metrics" and method == "GET":
            running = sum(1 for r in self.received if not r.finished)
            text = f"vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n"
            await _send_body(send, 200, text.encode(), [(b"content-type", b"text/plain; version=0.0.4")])
        elif path in ("/v1/chat/completions", "/v1/completions") and method == "POST":
            await self._generate(path.endswith("chat/completions"), receive, send)
        else:
            await _send_body(send, 404, b'{"detail":"Not Found"}', JSON_HEADERS)

    async def _generate(self, chat: bool, receive, send) -> None:
        body = orjson.loads(await _read_body(receive))
        record = Received(body)
        with self._lock:
            self.received.append(record)
        try:
            request = _Request(chat, body)
        except ValueError as exc:
            await _send_body(send, 400, orjson.dumps({"object": "error", "message": str(exc), "type": "BadRequestError",
                                                      "code": 400}), JSON_HEADERS)
            record.finished = True
            return
        record.prompt_tokens = sum(request.prompt_tokens)
        record.completion_tokens = sum(len(p) for p in request.plans)
        try:
            if body.get("stream") is True:
                await self._stream(request, send)
            else:
                await _send_body(send, 200, orjson.dumps(request.whole_answer()), JSON_HEADERS)
        finally:
            record.finished = True

    async def _stream(self, request: "_Request", send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        options = request.body.get("stream_options") or {}
        continuous, include_usage = options.get("continuous_usage_stats"), options.get("include_usage")
        done = [0] * len(request.plans)

        def event(choices: list[dict], index: int | None) -> bytes:
            chunk = request.chunk_base(choices)
            if continuous and index is not None:
                prompt = request.prompt_tokens[index // request.n]
                chunk["usage"] = _usage(prompt, done[index])
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        if request.chat:
            for index in range(len(request.plans)):
                await _write(send, event([request.role_choice(index)], index))
        for step in range(max((len(p) for p in request.plans), default=0)):
            for index, plan in enumerate(request.plans):
                if step >= len(plan):
                    continue
                done[index] += 1
                choice = request.token_choice(index, step)
                copies = 2 if self.duplicate_choices else 1
                await _write(send, event([choice] * copies, index))
            if step == 0 and self.out_of_range_choice:
                stray = {**request.token_choice(0, 0), "index": len(request.plans)}
                await _write(send, event([stray], None))
            await asyncio.sleep(0)
        for index in range(len(request.plans)):
            await _write(send, event([request.finish_choice(index)], index))
        tail = b""
        if include_usage:
            total = request.reported_completion(self.duplicate_choices, self.out_of_range_choice)
            chunk = request.chunk_base([]) | {"usage": _usage(sum(request.prompt_tokens), total)}
            tail = b"data: " + orjson.dumps(chunk) + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})


class _Request:
    """One request's plan: per choice, its pieces."""

    def __init__(self, chat: bool, body: dict) -> None:
        self.chat, self.body = chat, body
        self.n = body.get("n") or 1
        if type(self.n) is not int or self.n < 1:
            raise ValueError("n must be a positive integer")
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or ANSWER_WORDS * 4
        if chat:
            self.prompt_texts = [_last_user_text(body)]
            self.prompt_tokens = [honest_prompt_tokens(body)]
        else:
            prompts = _prompts(body.get("prompt"))
            self.prompt_texts = [p if isinstance(p, str) else "" for p in prompts]
            self.prompt_tokens = [max(1, len(p.encode()) // SIM_PROMPT_BYTES_PER_TOKEN) if isinstance(p, str) else len(p)
                                  for p in prompts]
        self.plans: list[list[Piece]] = []
        self.cut: list[bool] = []
        for prompt_index, text in enumerate(self.prompt_texts):
            for j in range(self.n):
                plan = self._plan(text, prompt_index * self.n + j)
                self.plans.append(plan[:limit])
                self.cut.append(len(plan) > limit)

    # What each choice generates
    def _plan(self, text: str, index: int) -> list[Piece]:
        body = self.body
        pieces: list[Piece] = []
        if self.chat and THINK in text:
            pieces += [Piece("reasoning", WORDS[(index + i) % len(WORDS)]) for i in range(REASONING_WORDS)]
        if self.chat and REFUSE in text:
            return pieces + [Piece("refusal", " " + word) for word in REFUSAL_TEXT.split()]
        calls = self._tool_calls(text) if self.chat else []
        for call, (name, arguments) in enumerate(calls):
            call_id = f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"
            pieces.append(Piece("tool_name", name, call, call_id))
            step = -(-len(arguments) // TOOL_ARGUMENT_PIECES)
            pieces += [Piece("tool_arguments", arguments[i:i + step], call, call_id) for i in range(0, len(arguments), step)]
        if calls:
            return pieces
        structured = _structured_text(body.get("response_format")) if self.chat else None
        if structured is not None:
            return pieces + [Piece("content", structured[i:i + STRUCTURED_PIECE_CHARS])
                             for i in range(0, len(structured), STRUCTURED_PIECE_CHARS)]
        return pieces + [Piece("content", WORDS[(index + i) % len(WORDS)]) for i in range(ANSWER_WORDS)]

    def _tool_calls(self, text: str) -> list[tuple[str, str]]:
        body = self.body
        tools = [t.get("function") for t in body.get("tools") or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
        messages = body.get("messages") or []
        choice = body.get("tool_choice")
        if not tools or choice == "none" or (messages and messages[-1].get("role") == "tool"):
            return []
        if isinstance(choice, dict):
            named = (choice.get("function") or {}).get("name")
            tools = [t for t in tools if t.get("name") == named] or tools[:1]
        elif PARALLEL not in text:
            tools = tools[:1]
        return [(t["name"], orjson.dumps(example_of(t.get("parameters") or {})).decode()) for t in tools]

    def finish_reason(self, index: int) -> str:
        if self.cut[index]:
            return "length"
        return "tool_calls" if any(p.kind == "tool_name" for p in self.plans[index]) else "stop"

    def reported_completion(self, duplicated: bool, stray: bool) -> int:
        total = sum(len(p) for p in self.plans)
        return total * (2 if duplicated else 1) + (1 if stray else 0)

    # Stream chunks
    def chunk_base(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.body.get("model"), "choices": choices}

    def role_choice(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def token_choice(self, index: int, step: int) -> dict:
        piece = self.plans[index][step]
        if not self.chat:
            offset = sum(len(p.text) for p in self.plans[index][:step])
            return {"index": index, "text": piece.text, "logprobs": self._completion_logprobs([piece], offset),
                    "finish_reason": None, "stop_reason": None}
        return {"index": index, "delta": _delta(piece), "logprobs": self._chat_logprobs([piece]), "finish_reason": None}

    def finish_choice(self, index: int) -> dict:
        if self.chat:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason(index)}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": self.finish_reason(index), "stop_reason": None}

    # Logprobs
    def _chat_logprobs(self, pieces: list[Piece]) -> dict | None:
        if self.body.get("logprobs") is not True:
            return None
        top = self.body.get("top_logprobs") or 0
        entries = [_chat_logprob(p.text, top) for p in pieces if p.kind == "content"]
        return {"content": entries} if entries else None

    def _completion_logprobs(self, pieces: list[Piece], offset: int) -> dict | None:
        top = self.body.get("logprobs")
        if type(top) is not int:
            return None
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for piece in pieces:
            logprob = _logprob_of(piece.text)
            logprobs["tokens"].append(piece.text)
            logprobs["token_logprobs"].append(logprob)
            logprobs["top_logprobs"].append({alt: lp for alt, lp in _alternatives(piece.text, logprob, top)})
            logprobs["text_offset"].append(offset)
            offset += len(piece.text)
        return logprobs

    # The whole answer
    def whole_answer(self) -> dict:
        choices = [self._whole_choice(index) for index in range(len(self.plans))]
        total = sum(len(p) for p in self.plans)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.body.get("model"), "choices": choices, "usage": _usage(sum(self.prompt_tokens), total)}

    def _whole_choice(self, index: int) -> dict:
        plan = self.plans[index]
        text = {kind: "".join(p.text for p in plan if p.kind == kind) for kind in ("content", "reasoning", "refusal")}
        if not self.chat:
            return {"index": index, "text": text["content"], "logprobs": self._completion_logprobs(plan, 0),
                    "finish_reason": self.finish_reason(index), "stop_reason": None}
        calls: dict[int, dict] = {}
        for piece in plan:
            if piece.kind == "tool_name":
                calls[piece.call] = {"id": piece.call_id, "type": "function", "function": {"name": piece.text, "arguments": ""}}
            elif piece.kind == "tool_arguments":
                calls[piece.call]["function"]["arguments"] += piece.text
        message = {"role": "assistant", "content": text["content"] or (None if calls or text["refusal"] else ""),
                   "refusal": text["refusal"] or None, "tool_calls": [calls[i] for i in sorted(calls)]}
        if text["reasoning"]:
            message["reasoning_content"] = text["reasoning"]
        return {"index": index, "message": message, "logprobs": self._chat_logprobs(plan),
                "finish_reason": self.finish_reason(index)}


def _delta(piece: Piece) -> dict:
    if piece.kind == "content":
        return {"content": piece.text}
    if piece.kind == "reasoning":
        return {"reasoning_content": piece.text}
    if piece.kind == "refusal":
        return {"refusal": piece.text}
    if piece.kind == "tool_name":  # opens the call
        return {"tool_calls": [{"index": piece.call, "id": piece.call_id, "type": "function",
                                "function": {"name": piece.text, "arguments": ""}}]}
    return {"tool_calls": [{"index": piece.call, "function": {"arguments": piece.text}}]}


def _logprob_of(text: str) -> float:
    return -round((len(text) % 7) / 8 + 0.125, 3)  # a fixed, readable number per token


def _alternatives(text: str, logprob: float, count: int) -> list[tuple[str, float]]:
    """The token itself first, then made-up alternatives, each less likely."""
    alternatives = [(text, logprob)] + [(f"{text.strip() or '_'}#{i}", logprob - TOP_LOGPROB_STEP * i) for i in range(1, count)]
    return alternatives[:count]


def _chat_logprob(text: str, top: int) -> dict:
    logprob = _logprob_of(text)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": alt, "logprob": lp, "bytes": list(alt.encode())}
                             for alt, lp in _alternatives(text, logprob, top)]}


def example_of(schema: dict) -> object:
    """A value of a JSON schema's type, every property of an object filled in."""
    if not isinstance(schema, dict):
        return None
    if schema.get("enum"):
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example_of(schema[key][0])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties") or {}
        names = list(properties) + [name for name in schema.get("required") or [] if name not in properties]
        return {name: example_of(properties.get(name, {"type": "string"})) for name in names}
    return {"array": lambda: [example_of(schema.get("items") or {"type": "string"})], "string": lambda: "warm map",
            "integer": lambda: 3, "number": lambda: 1.5, "boolean": lambda: True, "null": lambda: None,
            }.get(kind, lambda: "warm map")()


def _structured_text(response_format: object) -> str | None:
    if not isinstance(response_format, dict):
        return None
    if response_format.get("type") == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema") or {}
        return orjson.dumps(example_of(schema)).decode()
    if response_format.get("type") == "json_object":
        return orjson.dumps({"answer": "warm map"}).decode()
    return None


def _prompts(prompt: object) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and p) for p in prompt):
        return prompt
    raise ValueError("prompt must be a string, a list of strings, or (lists of) token ids")


def _last_user_text(body: dict) -> str:
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return content_text(message.get("content"))
    return ""


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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


def start_agent_worker(**options) -> ThreadedServer:
    """A started server; `server.app` is the AgentWorker. Stop it with `server.stop()`."""
    return ThreadedServer(AgentWorker(**options)).start()
