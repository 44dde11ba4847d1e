"""One request's stream: what the caller sees of the worker's chunks, and the
counts settlement needs. `InferenceProxy` (proxy/service.py) opens it and settles it."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import orjson

from ledger.money import nano_usd_to_usd_text
from proxy import metering, sse
from proxy import workers as registry
from proxy.errors import NotReady, ProxyError, UpstreamFailed
from proxy.keys import KeyGrant
from proxy.prices import Price
from proxy.upstream import UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    from proxy.service import InferenceProxy

CHAT, COMPLETIONS = "chat", "completions"


@dataclass
class Generation:
    proxy: InferenceProxy
    kind: str
    request_id: str
    model: str
    price: Price
    grant: KeyGrant
    hold_id: int
    hold_nano_usd: int
    prompt_bound: int
    max_tokens: int
    wants_usage: bool
    wants_continuous_usage: bool
    started_at: datetime
    streaming: bool = False  # the caller receives tokens as they come (what it has received is delivered)
    worker: registry.WorkerView | None = None
    upstream_body: dict | None = None
    tool_names: frozenset[str] = frozenset()  # the functions the request offered (use_worker)
    response: UpstreamResponse | None = None
    upstream: object = None  # the upstream event iterator
    pending: list[bytes] = field(default_factory=list)  # chunks read before the first token
    output: metering.OutputCount = field(default_factory=metering.OutputCount)  # what the caller received
    reported_prompt: int | None = None
    reported_completion: int | None = None
    first_token_at: float = 0.0
    upstream_done: bool = False  # [DONE] came before any token: an empty completion
    overran: bool = False  # the worker sent more tokens than the hold pays for
    hold_lost: bool = False  # the sweeper closed the hold while this ran (it could not be renewed in time)
    recorded_capture_nano_usd: int = 0  # the delivered usage last recorded against the hold
    settle_failed: bool = False  # a non-streaming answer whose charge could not be written is withheld
    finished: bool = False
    settling: asyncio.Task | None = None
    cost_nano_usd: int = 0
    usage: dict = field(default_factory=dict)
    created: int = 0

    # The relay
    def transform(self, data: bytes) -> bytes | None:
        """One upstream event to what the caller sees; None to hide it."""
        chunk = orjson.loads(data)
        if "error" in chunk and "choices" not in chunk:
            raise UpstreamFailed(f"the worker failed: {chunk['error']}")
        usage = chunk.pop("usage", None)
        if usage:
            self._note_usage(usage)
        choices = chunk.get("choices")
        if not choices:
            return None  # the final usage chunk: the caller gets ours, with the cost, after settling
        choice = self._sole_choice(chunk, choices)
        if choice is None:
            return None
        relayed_bytes = self._output_bytes(choice)
        if relayed_bytes:
            if self.counted_tokens >= self.max_tokens:  # never relay a token nobody pays for
                self.overran = True
                return None
            self.output.relayed_chunks += 1
            self.output.relayed_bytes += relayed_bytes
            if not self.first_token_at:
                self.first_token_at = time.perf_counter()
        if choice.get("finish_reason"):
            self.output.finished = True
        chunk["id"], chunk["model"] = self.request_id, self.model
        self.created = chunk.get("created") or self.created
        if usage and self.wants_continuous_usage:
            chunk["usage"] = usage
        return sse.encode(chunk)

    @property
    def counted_tokens(self) -> int:
        """Chunks relayed with output, each at least one token: max_tokens is
        enforced on this, so that nothing is relayed that the hold does not pay for."""
        return self.output.relayed_chunks

    def _note_usage(self, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if type(prompt) is int and prompt >= 0:
            self.reported_prompt = prompt
        if type(completion) is int and completion >= 0:
            self.reported_completion = completion

    def _sole_choice(self, chunk: dict, choices: object) -> dict | None:
        """The one choice a request with n=1 has; duplicates and malformed
        choices are dropped from the chunk and counted against the worker."""
        if type(choices) is list and len(choices) == 1 and _well_formed(self.kind, choices[0]):
            return choices[0]
        kept = None
        for choice in choices if type(choices) is list else ():
            if kept is None and _well_formed(self.kind, choice):
                kept = choice
            else:
                self.output.dropped += 1
        if type(choices) is not list:
            self.output.dropped += 1
        chunk["choices"] = [kept] if kept is not None else []
        return kept

    def _output_bytes(self, choice: dict) -> int:
        """UTF-8 bytes of output in one choice, as the caller receives them."""
        if self.kind != CHAT:
            return _str_bytes(choice.get("text"))
        delta = choice.get("delta")
        if not delta:
            return 0
        total = _str_bytes(delta.get("content"))
        reasoning_content, reasoning = delta.get("reasoning_content"), delta.get("reasoning")
        total += _str_bytes(reasoning_content)
        if reasoning != reasoning_content:  # vLLM sends the same text under both names
            total += _str_bytes(reasoning)
        if delta.get("tool_calls") is not None:
            total += self._tool_call_bytes(delta)
        return total

    def _tool_call_bytes(self, delta: dict) -> int:
        """Names and arguments relayed. Entries that are not objects, that skip
        an index or open more than TOOL_CALLS_PER_ANSWER_MAX calls are dropped."""
        tool_calls = delta["tool_calls"]
        if type(tool_calls) is not list:
            self.output.dropped += 1
            del delta["tool_calls"]
            return 0
        kept, total = [], 0
        for call in tool_calls:
            index = call.get("index", 0) if isinstance(call, dict) else None
            if not self._opens_or_continues(index):
                self.output.dropped += 1
                continue
            kept.append(call)
            function = call.get("function")
            if isinstance(function, dict):
                name = function.get("name")
                total += _str_bytes(name) + _str_bytes(function.get("arguments"))
                if type(name) is str and name in self.tool_names:  # a name not offered is relayed, without the allowance
                    self.output.tool_call_indexes.add(index)
        if len(kept) != len(tool_calls):
            delta["tool_calls"] = kept
        return total

    def _opens_or_continues(self, index: object) -> bool:
        """A call already open, or the next one: engines number calls 0, 1, 2, ..."""
        output = self.output
        if type(index) is not int or not 0 <= index <= output.tool_calls_opened:
            return False
        if index < output.tool_calls_opened:
            return True
        if output.tool_calls_opened >= metering.TOOL_CALLS_PER_ANSWER_MAX:
            return False
        output.tool_calls_opened += 1
        return True

    def delivered_usage(self) -> metering.BilledUsage:
        """What is billable of what has been relayed so far: the worker's latest
        report where the proxy's own count vouches for it (metering.billable_usage),
        never more completion tokens than the hold pays for."""
        billed = metering.billable_usage(self.reported_prompt, self.reported_completion,
                                         prompt_bound=self.prompt_bound, output=self.output)
        return billed._replace(completion_tokens=min(billed.completion_tokens, self.max_tokens))

    def use_worker(self, worker: registry.WorkerView | None, upstream_body: dict) -> None:
        """The attempt about to start, and what the proxy counts of its body once
        rather than per chunk: the functions offered, the stop strings asked for."""
        self.worker, self.upstream_body = worker, upstream_body
        self.tool_names = metering.offered_tool_names(upstream_body)
        self.output.stop_bytes = metering.stop_bytes_max(upstream_body)

    def forget_output(self) -> None:
        """A failed attempt before the first token: the next worker starts from nothing."""
        self.output = metering.OutputCount(stop_bytes=self.output.stop_bytes)
        self.reported_prompt = self.reported_completion = None

    async def events(self):
        """The caller's stream: what was read before the first token, the rest
        as it comes, then (after the settlement is durable) usage and [DONE]."""
        try:
            for chunk in self.pending:
                yield chunk
            self.pending = []
            if not self.upstream_done:
                async for data in self.upstream:
                    if data == sse.DONE:  # the worker ended its answer (with or without a finish_reason)
                        self.output.finished = True
                        break
                    out = self.transform(data)
                    if out is not None:
                        yield out
                    if self.overran or self.hold_lost:
                        break  # stop the worker; what it produced is billed below
                else:
                    raise UpstreamFailed("the worker's stream ended without [DONE]")
            # Its own task: a caller leaving now cannot interrupt the settlement.
            await asyncio.shield(self.proxy.settle(self))
            if self.wants_usage:
                yield sse.encode(self.usage_chunk())
            yield sse.DONE_EVENT
        except (UpstreamError, UpstreamFailed, ValueError) as exc:
            # The worker failed mid-stream: a streaming caller keeps what it received and pays for it.
            await asyncio.shield(self.proxy.settle(self, charge=self.streaming))
            error = exc if isinstance(exc, ProxyError) else UpstreamFailed(f"the worker failed mid-stream: {type(exc).__name__}")
            yield sse.encode({"error": {"message": str(error), "type": error.error_type, "code": error.code, "param": None}})
        finally:
            self.proxy.settle(self)  # the caller went away: bill what was produced (a no-op once settling)
            await self.close_upstream()

    async def close_upstream(self) -> None:
        """Back to the pool when the response ended cleanly; otherwise the
        connection is closed, which stops the worker."""
        if self.response is not None:
            self.response.close()

    def usage_dict(self) -> dict:
        return {**self.usage, "cost": nano_usd_to_usd_text(self.cost_nano_usd)}

    def usage_chunk(self) -> dict:
        object_name = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage_dict()}

    async def collect(self) -> dict:
        """A non-streaming answer, assembled from the same stream."""
        message, finish_reason, error = _MessageParts(), None, None
        async for event in self.events():
            payload = event[6:].strip()
            if payload == sse.DONE:
                continue
            chunk = orjson.loads(payload)
            if "error" in chunk:
                error = chunk["error"]
                continue
            for choice in chunk.get("choices") or ():
                if self.kind == CHAT:
                    message.add(choice.get("delta") or {})
                elif choice.get("text"):
                    message.content.append(choice["text"])
                finish_reason = choice.get("finish_reason") or finish_reason
        if self.settle_failed:
            raise NotReady("the answer could not be billed just now, so it is withheld; nothing was charged: try again")
        if error is not None:
            raise UpstreamFailed(error["message"])
        if self.kind == CHAT:
            choice = {"index": 0, "message": message.assembled(), "logprobs": None, "finish_reason": finish_reason}
            object_name = "chat.completion"
        else:
            choice = {"index": 0, "text": "".join(message.content), "logprobs": None, "finish_reason": finish_reason}
            object_name = "text_completion"
        return {"id": self.request_id, "object": object_name, "created": self.created or int(time.time()),
                "model": self.model, "choices": [choice], "usage": self.usage_dict()}


class _MessageParts:
    """An assistant message put back together from its deltas."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict] = {}

    def add(self, delta: dict) -> None:
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str):
            self.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or ():
            whole = self.tool_calls.setdefault(call.get("index", 0), {"id": None, "type": "function",
                                                                      "function": {"name": "", "arguments": ""}})
            whole["id"] = call.get("id") or whole["id"]
            function = call.get("function") if isinstance(call.get("function"), dict) else {}
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    whole["function"][key] += function[key]

    def assembled(self) -> dict:
        message = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            message["content"] = message["content"] or None
        return message


def _well_formed(kind: str, choice: object) -> bool:
    """A choice the caller may get: an object for index 0, its delta an object."""
    if type(choice) is not dict or choice.get("index", 0) != 0:
        return False
    if kind != CHAT:
        return _text_or_none(choice.get("text"))
    delta = choice.get("delta") or {}
    return (type(delta) is dict and _text_or_none(delta.get("content"))
            and _text_or_none(delta.get("reasoning_content")) and _text_or_none(delta.get("reasoning")))


def _text_or_none(value: object) -> bool:
    return value is None or type(value) is str


def _str_bytes(value: object) -> int:
    return len(value.encode()) if type(value) is str else 0
