"""The simulated worker's `POST /v1/responses`, in vLLM's shapes: `response.*`
events (streaming) or one response object, with honest usage
(`input_tokens`, `output_tokens`).

The input is read as the chat messages vLLM renders it into (instructions a
system turn, messages, function calls and their outputs), so its prompt
tokens are counted as chat's are (proxy/sim/requests.py), and the sim_*
fields and the app's behaviours apply as they do to chat.

A request that offers function tools and whose input does not end with a
function_call_output is answered with a call to the first tool: its
arguments are `{"input": "<the generated text>"}`, one token per word, the
JSON around them sent with the first and last words. Otherwise the answer is
a message of the generated text. `max_output_tokens` reached is an
incomplete response (reason max_output_tokens), as vLLM answers."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import orjson

from proxy.limits import SIM_REQUEST_BODY_BYTES_MAX, SIM_TOOL_CALL_ID_HEX_CHARS
from proxy.sim.emitters import JSON_HEADERS, SSE_HEADERS, Send, send_body
from proxy.sim.engine import Call, GenerationRequest, SimulatedCrash
from proxy.sim.requests import Behaviour, HttpError, bad_request, parse_request

ARGUMENTS_HEAD, ARGUMENTS_TAIL = '{"input": "', '"}'


def parse(body: bytes, *, model: str, max_model_len: int, behaviour: Behaviour) -> tuple[GenerationRequest, dict]:
    """The generation to run, and the Responses request it answers."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    chat = {key: value for key, value in data.items() if key.startswith("sim_") or key in ("model", "stream")}
    chat["messages"] = _messages(data.get("instructions"), data.get("input"))
    tools = data.get("tools") or []
    if tools:
        chat["tools"] = tools
    if data.get("max_output_tokens") is not None:
        chat["max_tokens"] = data["max_output_tokens"]
    request = parse_request(orjson.dumps(chat), chat=True, model=model, max_model_len=max_model_len, behaviour=behaviour)
    return request, data


def _messages(instructions: Any, items: Any) -> list[dict]:
    messages = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("input must be a string or a list of items")
    for item in items:
        if not isinstance(item, dict):
            raise bad_request("each input item must be an object")
        kind = item.get("type", "message")
        if kind == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments")}
            messages.append({"role": "assistant", "tool_calls": [{"function": function}]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "content": item.get("output") if isinstance(item.get("output"), str) else ""})
        elif kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"))})
        else:
            raise bad_request(f"unknown input item type {kind!r}")
    return messages


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("a message's content must be a string or a list of parts")
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def calls_a_tool(data: dict) -> str | None:
    """The function the answer calls, if any."""
    tools = data.get("tools") or []
    items = data.get("input")
    last = items[-1] if isinstance(items, list) and items else None
    if not tools or (isinstance(last, dict) and last.get("type") == "function_call_output"):
        return None
    return tools[0].get("name")


class _ResponseShape:
    """One answer's response object and output item, as they are built."""

    def __init__(self, request: GenerationRequest, data: dict, model: str) -> None:
        self.request = request
        self.data = data
        self.tool = calls_a_tool(data)
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"fc_{uuid.uuid4().hex}" if self.tool else f"msg_{uuid.uuid4().hex}"
        self.call_id = f"call_{uuid.uuid4().hex[:SIM_TOOL_CALL_ID_HEX_CHARS]}"
        self.response = {
            "id": self.response_id, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress", "output": [], "usage": None, "error": None, "incomplete_details": None,
            "instructions": data.get("instructions"), "tools": data.get("tools") or [],
            "tool_choice": data.get("tool_choice") or "auto", "parallel_tool_calls": data.get("parallel_tool_calls", True),
            "temperature": data.get("temperature"), "top_p": data.get("top_p"),
            "max_output_tokens": data.get("max_output_tokens"), "metadata": {}, "text": {"format": {"type": "text"}},
            "reasoning": None, "store": False, "truncation": "disabled",
        }

    def item(self, text: str, status: str) -> dict:
        if self.tool:
            return {"id": self.item_id, "type": "function_call", "call_id": self.call_id, "name": self.tool,
                    "arguments": text, "status": status}
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "empty" else []
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def arguments(self, text: str) -> str:
        return ARGUMENTS_HEAD + orjson.dumps(text).decode()[1:-1] + ARGUMENTS_TAIL

    def final(self, completion_tokens: int, text: str) -> dict:
        k = self.request.usage_multiplier
        prompt_tokens, output_tokens = self.request.prompt_tokens * k, completion_tokens * k
        incomplete = self.request.finish_reason == "length" and completion_tokens >= self.request.max_tokens
        output = []
        if completion_tokens:
            output = [self.item(self.arguments(text) if self.tool else text, "completed")]
        return {**self.response, "status": "incomplete" if incomplete else "completed", "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                          "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": prompt_tokens + output_tokens}}


class ResponsesStreamEmitter:
    """Writes one answer's `response.*` events as the engine produces its tokens."""

    def __init__(self, request: GenerationRequest, send: Send, call: Call, data: dict, model: str) -> None:
        self.request = request
        self._send = send
        self._call = call
        self.shape = _ResponseShape(request, data, model)
        self._sequence = 0
        self._text: list[str] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    async def _write(self, body: bytes) -> None:
        await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def start(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await self._write(self._event("response.created", response=self.shape.response)
                          + self._event("response.in_progress", response=self.shape.response))

    async def token(self, index: int, word: str, word_json: bytes) -> None:
        shape, head = self.shape, b""
        if index == 0:
            head = self._event("response.output_item.added", output_index=0, item=shape.item("", "in_progress"))
            if not shape.tool:
                head += self._event("response.content_part.added", item_id=shape.item_id, output_index=0, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self._text.append(word)
        if shape.tool:
            delta = (ARGUMENTS_HEAD if index == 0 else "") + orjson.dumps(word).decode()[1:-1]
            body = self._event("response.function_call_arguments.delta", item_id=shape.item_id, output_index=0, delta=delta)
        else:
            body = self._event("response.output_text.delta", item_id=shape.item_id, output_index=0, content_index=0,
                               delta=word, logprobs=[])
        await self._write(head + body)

    async def finish(self, completion_tokens: int, text: str) -> None:
        shape, tail = self.shape, b""
        final = shape.final(completion_tokens, "".join(self._text))
        if completion_tokens:
            item = final["output"][0]
            if shape.tool:
                tail += self._event("response.function_call_arguments.delta", item_id=shape.item_id, output_index=0,
                                    delta=ARGUMENTS_TAIL)
                tail += self._event("response.function_call_arguments.done", item_id=shape.item_id, output_index=0,
                                    name=shape.tool, arguments=item["arguments"])
            else:
                part = item["content"][0]
                tail += self._event("response.output_text.done", item_id=shape.item_id, output_index=0, content_index=0,
                                    text=part["text"], logprobs=[])
                tail += self._event("response.content_part.done", item_id=shape.item_id, output_index=0, content_index=0,
                                    part=part)
            tail += self._event("response.output_item.done", output_index=0, item=item)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        tail += self._event(kind, response=final)
        self._call.finished = True  # completing the response wakes the disconnect watcher
        await self._send({"type": "http.response.body", "body": tail, "more_body": False})


class ResponsesJsonEmitter:
    """Answers the whole response object once it is generated."""

    def __init__(self, request: GenerationRequest, send: Send, call: Call, data: dict, model: str) -> None:
        self._send = send
        self._call = call
        self.shape = _ResponseShape(request, data, model)
        self._text: list[str] = []

    async def start(self) -> None:
        return None

    async def token(self, index: int, word: str, word_json: bytes) -> None:
        self._text.append(word)

    async def finish(self, completion_tokens: int, text: str) -> None:
        self._call.finished = True
        final = self.shape.final(completion_tokens, "".join(self._text))
        await send_body(self._send, 200, orjson.dumps(final), JSON_HEADERS)


async def endpoint(worker, scope: dict, receive, send: Send) -> None:
    """POST /v1/responses on a SimWorker (proxy/sim/worker.py), run as its chat requests are."""
    behaviour = Behaviour(worker.stop_after_tokens, worker.fail_after_tokens, worker.extra_tokens, worker.inflate_usage)
    try:
        request, data = parse(await _read_body(receive), model=worker.model, max_model_len=worker.max_model_len,
                              behaviour=behaviour)
    except HttpError as error:
        await send_body(send, error.status, error.body(), JSON_HEADERS)
        return
    except ConnectionResetError:
        return
    if request.fail_before_first_token:
        worker.state.requests_failed += 1
        error = HttpError(500, "InternalServerError", "Simulated failure before the first token.")
        await send_body(send, error.status, error.body(), JSON_HEADERS)
        return
    loop = asyncio.get_running_loop()
    call = Call(loop)
    emitter_class = ResponsesStreamEmitter if request.stream else ResponsesJsonEmitter
    emitter = emitter_class(request, send, call, data, worker.model)
    worker.state.requests_started += 1
    watcher = loop.create_task(_watch_disconnect(receive, call))
    try:
        await emitter.start()
        await worker.engine.generate(request, call, emitter)
    except SimulatedCrash:  # returning without completing the response drops the connection
        worker.state.requests_failed += 1
        return
    finally:
        call.finished = True
        watcher.cancel()
    if call.disconnected:
        worker.state.requests_aborted += 1
    else:
        worker.state.requests_finished += 1


async def _read_body(receive) -> bytes:
    parts, size_bytes = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client left before sending its request")
        parts.append(message.get("body", b""))
        size_bytes += len(parts[-1])
        if size_bytes > SIM_REQUEST_BODY_BYTES_MAX:
            raise HttpError(413, "BadRequestError", f"request body above {SIM_REQUEST_BODY_BYTES_MAX} bytes")
        if not message.get("more_body", False):
            return b"".join(parts)


async def _watch_disconnect(receive, call: Call) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    call.on_disconnect()
