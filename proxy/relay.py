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
from proxy.errors import ProxyError, UpstreamFailed
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
    response: UpstreamResponse | None = None
    upstream: object = None  # the upstream event iterator
    pending: list[bytes] = field(default_factory=list)  # chunks read before the first token
    counted_tokens: int = 0
    reported_prompt: int | None = None
    reported_completion: int | None = None
    first_token_at: float = 0.0
    upstream_done: bool = False  # [DONE] came before any token: an empty completion
    overran: bool = False  # the worker sent more tokens than the hold pays for
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
            self.reported_prompt = usage.get("prompt_tokens", self.reported_prompt)
            self.reported_completion = usage.get("completion_tokens", self.reported_completion)
        choices = chunk.get("choices")
        if not choices:
            return None  # the final usage chunk: the caller gets ours, with the cost, after settling
        for choice in choices:
            if _has_output(self.kind, choice):
                if self.counted_tokens >= self.max_tokens:  # never relay a token nobody pays for
                    self.overran = True
                    return None
                self.counted_tokens += 1
                if not self.first_token_at:
                    self.first_token_at = time.perf_counter()
        chunk["id"], chunk["model"] = self.request_id, self.model
        self.created = chunk.get("created") or self.created
        if usage and self.wants_continuous_usage:
            chunk["usage"] = usage
        return sse.encode(chunk)

    async def events(self):
        """The caller's stream: what was read before the first token, the rest
        as it comes, then (after the settlement is durable) usage and [DONE]."""
        try:
            for chunk in self.pending:
                yield chunk
            self.pending = []
            if not self.upstream_done:
                async for data in self.upstream:
                    if data == sse.DONE:
                        break
                    out = self.transform(data)
                    if out is not None:
                        yield out
                    elif self.overran:
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

    def delivered_usage(self) -> metering.BilledUsage:
        """What is billable of what has been relayed so far (the rule settlement uses)."""
        billed = metering.billable_usage(self.reported_prompt, self.reported_completion,
                                         prompt_bound=self.prompt_bound, counted_completion=self.counted_tokens)
        return billed._replace(completion_tokens=min(billed.completion_tokens, self.max_tokens))

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
        text, finish_reason, error = [], None, None
        async for event in self.events():
            payload = event[6:].strip()
            if payload == sse.DONE:
                continue
            chunk = orjson.loads(payload)
            if "error" in chunk:
                error = chunk["error"]
                continue
            for choice in chunk.get("choices") or ():
                part = choice.get("delta", {}).get("content") if self.kind == CHAT else choice.get("text")
                if part:
                    text.append(part)
                finish_reason = choice.get("finish_reason") or finish_reason
        if error is not None:
            raise UpstreamFailed(error["message"])
        content = "".join(text)
        if self.kind == CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": finish_reason}
            object_name = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
            object_name = "text_completion"
        return {"id": self.request_id, "object": object_name, "created": self.created or int(time.time()),
                "model": self.model, "choices": [choice], "usage": self.usage_dict()}


def _has_output(kind: str, choice: dict) -> bool:
    if kind != CHAT:
        return bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
