"""One Responses request's stream: the worker's `response.*` events as the
caller sees them, counted as chat's chunks are (proxy/generation.py).

What the caller receives is rebuilt from what was relayed, never taken from
the worker's word for it: every output item starts empty and grows only by
the deltas relayed (text, refusals, reasoning, function-call arguments; a
call's name when its item is added), each delta counted in bytes toward the
completion bound, and every `.done` event, the final output and the stored
items carry that accumulated text, whatever the worker put in them. Events the
proxy does not know are not relayed. Every event is renumbered
(`sequence_number`) and carries the proxy's response id and model name.

The worker's own `response.completed` (or `.incomplete`) ends the stream and
gives its usage; the caller's is sent after the settlement is durable, with
the usage billed and its cost (`usage.cost`, a JSON number of nine decimals,
and `usage.cost_details.nano_usd`)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson

from ledger.money import nano_usd_to_usd_text
from proxy import metering, sse
from proxy.errors import NotReady, ProxyError, UpstreamFailed
from proxy.generation import Collector, Generation
from proxy.limits import RESPONSE_OUTPUT_ITEMS_MAX, TOOL_CALLS_PER_ANSWER_MAX
from proxy.metering import utf8_bytes
from proxy.responses.request import ResponsesRequest

log = logging.getLogger(__name__)

PATH = "/v1/responses"
LIFECYCLE = frozenset({"response.created", "response.queued", "response.in_progress"})
TERMINAL = frozenset({"response.completed", "response.incomplete"})
FAILED = frozenset({"response.failed", "error"})
# Delta events: (the key of the text they add to, what they add to)
TEXT_DELTAS = {
    "response.output_text.delta": "text",
    "response.refusal.delta": "refusal",
    "response.reasoning_text.delta": "text",
}
TEXT_DONES = {
    "response.output_text.done": "text",
    "response.refusal.done": "refusal",
    "response.reasoning_text.done": "text",
}
# What a content part the worker adds may be, per item type, and its empty shape.
EMPTY_PARTS = {
    ("message", "output_text"): {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
    ("message", "refusal"): {"type": "refusal", "refusal": ""},
    ("reasoning", "reasoning_text"): {"type": "reasoning_text", "text": ""},
}
# Stores a finished response's items (relay.py); given the generation.
Keep = Callable[["ResponsesGeneration"], Awaitable[None]]


class _Malformed(Exception):
    """An event whose shape does not fit what was relayed so far: dropped, counted against the worker."""


@dataclass(eq=False)
class ResponsesGeneration(Generation):
    request: ResponsesRequest | None = None
    keep: Keep | None = None
    # The caller's stream
    sequence: int = field(default=0, init=False)
    items: dict[int, dict] = field(default_factory=dict, init=False)  # output index: the item as relayed so far
    done_items: set[int] = field(default_factory=set, init=False)
    shell: dict | None = field(default=None, init=False)  # the response object of the lifecycle events
    upstream_status: str | None = field(default=None, init=False)
    incomplete_details: object = field(default=None, init=False)
    answer: dict | None = field(default=None, init=False)  # the final response, as the caller gets it
    error: dict | None = field(default=None, init=False)

    def upstream_url(self) -> str:
        return self.worker.url + PATH

    def forget_attempt(self):
        worker = super().forget_attempt()
        self.sequence, self.items, self.done_items, self.shell = 0, {}, set(), None
        self.upstream_status = self.incomplete_details = None
        return worker

    def end_of_stream(self) -> None:
        self.reading_over = True
        self._end(None)

    @property
    def _single(self) -> metering.OutputCount:
        """A response is one choice: its counts."""
        return self.output.choices[0]

    # One upstream event
    def transform(self, data: bytes) -> bytes | None:
        event = orjson.loads(data)
        kind = event.get("type") if isinstance(event, dict) else None
        if kind in FAILED:
            raise UpstreamFailed(f"the worker failed: {_error_message(event)}")
        if kind in TERMINAL:
            self._end(event.get("response"))
            return None
        handler = _HANDLERS.get(kind) if kind not in LIFECYCLE else ResponsesGeneration._lifecycle
        if handler is None:
            return None
        try:
            return handler(self, event)
        except (_Malformed, KeyError, IndexError, TypeError, AttributeError):
            self._single.dropped += 1
            return None

    def _end(self, response: object) -> None:
        self.upstream_done = self._single.finished = True
        if isinstance(response, dict):
            self._note_response_usage(response.get("usage"))
            self.upstream_status = response.get("status")
            self.incomplete_details = response.get("incomplete_details")

    def _note_response_usage(self, usage: object) -> None:
        if isinstance(usage, dict):
            self._note_usage({"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}, None)

    def _lifecycle(self, event: dict) -> bytes | None:
        if event["type"] == "response.created" and self.sequence:
            raise _Malformed("a second response.created")
        response = event["response"]
        if not isinstance(response, dict):
            raise _Malformed("no response object")
        self.created = response.get("created_at") if type(response.get("created_at")) is int else self.created
        # No usage until the end: OpenAI's document allows none rather than null
        self.shell = {key: value for key, value in response.items() if key != "usage"} | self._echo() | {"output": []}
        event["response"] = {**self.shell, "status": "in_progress" if event["type"] != "response.queued" else "queued"}
        return self._emit(event)

    def _item_added(self, event: dict) -> bytes | None:
        index, item = event["output_index"], event["item"]
        if type(index) is not int or index in self.items or len(self.items) >= RESPONSE_OUTPUT_ITEMS_MAX:
            raise _Malformed("an output index already used, or one too many")
        kept, relayed_bytes = _empty_item(item)
        if kept["type"] == "function_call":
            if self._single.tool_calls_opened >= TOOL_CALLS_PER_ANSWER_MAX:
                raise _Malformed("too many function calls")
        if not self._may_relay(relayed_bytes):
            return None
        if kept["type"] == "function_call":
            self._single.tool_calls_opened += 1
            if kept["name"] in self.tool_names:  # a name not offered is relayed, without the allowance
                self._single.tool_call_indexes.add(index)
        self.items[index] = kept
        event["item"] = kept
        return self._emit(event)

    def _part_added(self, event: dict) -> bytes | None:
        event["type"] = "response.content_part.added"  # vLLM's response.reasoning_part.added is this event
        item = self._open_item(event)
        part = event["part"]
        empty = EMPTY_PARTS.get((item["type"], part.get("type")))
        content = item.setdefault("content", [])
        if empty is None or event["content_index"] != len(content):
            raise _Malformed("a content part out of place")
        content.append(dict(empty))
        event["part"] = dict(empty)
        return self._emit(event)

    def _text_delta(self, event: dict) -> bytes | None:
        key = TEXT_DELTAS[event["type"]]
        part = self._open_part(event, key)
        delta = event["delta"]
        if not isinstance(delta, str) or not self._may_relay(utf8_bytes(delta)):
            return None
        part[key] += delta
        if event["type"] == "response.output_text.delta":
            event["logprobs"] = []
        return self._emit(event)

    def _text_done(self, event: dict) -> bytes | None:
        key = TEXT_DONES[event["type"]]
        event[key] = self._open_part(event, key)[key]
        if event["type"] == "response.output_text.done":
            event["logprobs"] = []
        return self._emit(event)

    def _part_done(self, event: dict) -> bytes | None:
        event["type"] = "response.content_part.done"
        item = self._open_item(event)
        event["part"] = dict(item["content"][event["content_index"]])
        return self._emit(event)

    def _summary_part_added(self, event: dict) -> bytes | None:
        item = self._open_item(event)
        if item["type"] != "reasoning" or event["summary_index"] != len(item["summary"]):
            raise _Malformed("a summary part out of place")
        item["summary"].append({"type": "summary_text", "text": ""})
        event["part"] = {"type": "summary_text", "text": ""}
        return self._emit(event)

    def _summary_text_delta(self, event: dict) -> bytes | None:
        part = self._summary_part(event)
        delta = event["delta"]
        if not isinstance(delta, str) or not self._may_relay(utf8_bytes(delta)):
            return None
        part["text"] += delta
        return self._emit(event)

    def _summary_text_done(self, event: dict) -> bytes | None:
        event["text"] = self._summary_part(event)["text"]
        return self._emit(event)

    def _summary_part_done(self, event: dict) -> bytes | None:
        event["part"] = dict(self._summary_part(event))
        return self._emit(event)

    def _arguments_delta(self, event: dict) -> bytes | None:
        item = self._open_item(event, "function_call")
        delta = event["delta"]
        if not isinstance(delta, str) or not self._may_relay(utf8_bytes(delta)):
            return None
        item["arguments"] += delta
        return self._emit(event)

    def _arguments_done(self, event: dict) -> bytes | None:
        item = self._open_item(event, "function_call")
        event["arguments"] = item["arguments"]
        if "name" in event:
            event["name"] = item["name"]
        return self._emit(event)

    def _item_done(self, event: dict) -> bytes | None:
        index = event["output_index"]
        item = self._open_item(event)
        item["status"] = "completed"
        self.done_items.add(index)
        event["item"] = item
        return self._emit(event)

    def _open_item(self, event: dict, kind: str | None = None) -> dict:
        index = event["output_index"]
        item = self.items.get(index) if type(index) is int else None
        if item is None or index in self.done_items or (kind is not None and item["type"] != kind):
            raise _Malformed("no such item open")
        return item

    def _open_part(self, event: dict, key: str) -> dict:
        part = self._open_item(event)["content"][event["content_index"]]
        if key not in part or type(event["content_index"]) is not int:
            raise _Malformed("no such part")
        return part

    def _summary_part(self, event: dict) -> dict:
        index = event["summary_index"]
        if type(index) is not int:
            raise _Malformed("no such summary part")
        return self._open_item(event, "reasoning")["summary"][index]

    def _may_relay(self, relayed_bytes: int) -> bool:
        """Counts output about to be relayed; False when the hold pays for no more."""
        if not relayed_bytes:
            return True
        if self.counted_tokens >= self.max_tokens:  # never relay a token nobody pays for
            self.overran = True
            return False
        self._single.relayed_chunks += 1
        self._single.relayed_bytes += relayed_bytes
        if not self.first_token_at:
            self.first_token_at = time.perf_counter()
        return True

    def _emit(self, event: dict) -> bytes:
        """The event as the caller gets it; a stream always opens with response.created."""
        opening = b""
        if not self.sequence and event.get("type") != "response.created":
            self.shell = self.shell or self._default_shell()
            opening = self._emit({"type": "response.created", "response": {**self.shell, "status": "in_progress"}})
        event["sequence_number"] = self.sequence
        self.sequence += 1
        if "response_id" in event:
            event["response_id"] = self.request_id
        return opening + b"event: " + event["type"].encode() + b"\n" + sse.encode(event)

    def _echo(self) -> dict:
        """What the response says of its request that the worker was not told (it keeps nothing)."""
        request = self.request
        tools = request.upstream_fields.get("tools", []) if request else []
        return {"id": self.request_id, "model": self.model, "store": request.store if request else True,
                "previous_response_id": request.previous_response_id if request else None,
                # the tools as asked, with the fields OpenAI's answer always has
                "tools": [{"parameters": None, "strict": None, **tool} for tool in tools]}

    def _default_shell(self) -> dict:
        fields = self.request.upstream_fields if self.request else {}
        return {"object": "response", "created_at": self.created or int(time.time()), "status": "in_progress",
                "output": [], "error": None, "incomplete_details": None,
                "instructions": fields.get("instructions"), "tool_choice": "auto",
                "parallel_tool_calls": True, "metadata": {}, "text": {"format": {"type": "text"}}, **self._echo()}

    # The caller's stream: Generation.relay_to, ending with the final response
    ENDED_EARLY = "the worker's stream ended before its response did"

    async def closing_chunks(self) -> list[bytes]:
        """After the settlement: the final response with its usage, once its items are kept."""
        if self.settle_failed:
            return []
        final = self._final_event()
        await self._keep()  # before the caller has the id it may continue from
        return [final]

    def error_chunk(self, error: ProxyError) -> bytes:
        self.error = {"type": "error", "code": error.code, "message": str(error), "param": None}
        return self._emit(dict(self.error))

    def _final_event(self) -> bytes:
        complete = (self.output.finished and not (self.overran or self.hold_lost)
                    and self.upstream_status in (None, "completed"))
        output = [{**item, "status": "completed" if index in self.done_items else "incomplete"}
                  for index, item in sorted(self.items.items())]
        shell = self.shell or self._default_shell()
        self.answer = {**shell, "status": "completed" if complete else "incomplete", "output": output,
                       "usage": self.billed_usage()}
        if not complete:
            self.answer["incomplete_details"] = self.incomplete_details or {"reason": "max_output_tokens"}
        kind = "response.completed" if complete else "response.incomplete"
        return self._emit({"type": kind, "response": self.answer})

    def billed_usage(self) -> dict:
        """The usage billed, in the Responses API's names, with its cost."""
        prompt, completion = self.usage.get("prompt_tokens", 0), self.usage.get("completion_tokens", 0)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion, "cost": orjson.Fragment(nano_usd_to_usd_text(self.cost_nano_usd)),
                "cost_details": {"nano_usd": self.cost_nano_usd}}

    async def _keep(self) -> None:
        """Store the items for a follow-up; the answer stands if that fails (the follow-up is then a 404)."""
        if self.keep is None or self.request is None or not self.request.store:
            return
        try:
            await asyncio.shield(self.keep(self))
        except Exception:
            log.warning("response %s: its items could not be stored", self.request_id, exc_info=True)

    async def collect(self) -> dict:
        """A non-streaming answer: the final response of the same stream."""
        await self.relay_to(Collector(lambda chunk: None))  # what counts is kept on the generation
        if self.settle_failed:
            raise NotReady("the answer could not be billed just now, so it is withheld; nothing was charged: try again")
        if self.error is not None or self.answer is None:
            raise UpstreamFailed(self.error["message"] if self.error else "the worker gave no answer")
        return self.answer

    def output_items(self) -> list[dict]:
        return list(self.answer["output"]) if self.answer else []


def _empty_item(item: dict) -> tuple[dict, int]:
    """An output item as it starts, and the bytes of output it already carries (a call's name)."""
    kind = item["type"]
    item_id = item.get("id") if isinstance(item.get("id"), str) else None
    if kind == "message":
        return {"id": item_id or f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}, 0
    if kind == "function_call":
        name, call_id = item["name"], item.get("call_id")
        if not isinstance(name, str) or not name or not isinstance(call_id, str):
            raise _Malformed("a function call needs a name and a call_id")
        return {"id": item_id or f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
                "arguments": "", "status": "in_progress"}, utf8_bytes(name)
    if kind == "reasoning":
        return {"id": item_id or f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": []}, 0
    raise _Malformed(f"output items of type {kind!r} are not relayed")


def _error_message(event: dict) -> str:
    error = event.get("error") or (event.get("response") or {}).get("error") or event
    return str(error.get("message", error) if isinstance(error, dict) else error)


_HANDLERS = {
    "response.output_item.added": ResponsesGeneration._item_added,
    "response.output_item.done": ResponsesGeneration._item_done,
    "response.content_part.added": ResponsesGeneration._part_added,
    "response.content_part.done": ResponsesGeneration._part_done,
    "response.reasoning_part.added": ResponsesGeneration._part_added,
    "response.reasoning_part.done": ResponsesGeneration._part_done,
    **dict.fromkeys(TEXT_DELTAS, ResponsesGeneration._text_delta),
    **dict.fromkeys(TEXT_DONES, ResponsesGeneration._text_done),
    "response.reasoning_summary_part.added": ResponsesGeneration._summary_part_added,
    "response.reasoning_summary_part.done": ResponsesGeneration._summary_part_done,
    "response.reasoning_summary_text.delta": ResponsesGeneration._summary_text_delta,
    "response.reasoning_summary_text.done": ResponsesGeneration._summary_text_done,
    "response.function_call_arguments.delta": ResponsesGeneration._arguments_delta,
    "response.function_call_arguments.done": ResponsesGeneration._arguments_done,
}
