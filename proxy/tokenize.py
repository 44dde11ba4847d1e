"""The engine's own count of a long prompt, asked of a worker and cached.

The byte bound (proxy/metering.py) is about four times the tokens a worker
counts, so near a context limit it refuses prompts that fit. Only then (the
byte bound does not fit every worker of the model) the proxy asks a worker
of the model for its count: vLLM's POST /tokenize ({"model", "messages"}
renders the chat template with the generation prompt, {"model", "prompt"} a
completion prompt; it answers {"count", "max_model_len", "tokens"}), or
llama.cpp's POST /apply-template ({"messages"} -> {"prompt"}) then POST
/tokenize ({"content"} -> {"tokens"}). Short prompts are never counted: the
hot path gains no round trip.

A count comes from a third party's worker and may lie, so it can only lower
the bound, never raise it: the bound in force is min(byte bound, count +
margin). Routing, the hold and the prompt's billing use it; a worker's
report above it is billed at it and recorded as a discrepancy, as above the
byte bound. A count too low sends the prompt to a worker too small, whose
own "too long" is retried on a larger one (proxy/service.py) and makes the
proxy forget that count and ask another worker next time; a count too high
only routes to larger workers, and before a prompt is refused on a count,
a second worker is asked and the smaller count wins.

Per model the counter remembers which worker answered (asked first next
time), and keeps the counts of recent prompts, keyed by a digest of what the
worker's template renders, so that a retried agent prompt is counted once.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from typing import NamedTuple

import orjson

from ledger.money import PERCENT
from proxy import workers as registry
from proxy.forwarded_fields import PROMPT_FIELDS
from proxy.generation import CHAT
from proxy.limits import (
    COUNTED_PROMPT_MARGIN_PERCENT,
    COUNTED_PROMPT_MARGIN_TOKENS_MIN,
    TOKENIZE_CACHE_ENTRIES_MAX,
    TOKENIZE_KEY_BYTES,
    TOKENIZE_TIMEOUT_S,
    TOKENIZE_WORKERS_ASKED_MAX,
)
from proxy.upstream import UpstreamError, UpstreamPool

class Counted(NamedTuple):
    tokens: int
    worker_id: int  # who counted


def bound_in_force(byte_bound: int, counted_tokens: int | None) -> int:
    """The prompt bound routing, the hold and billing use: the count plus its
    margin, never above the byte bound no worker can move."""
    if counted_tokens is None:
        return byte_bound
    margin = max(COUNTED_PROMPT_MARGIN_TOKENS_MIN, counted_tokens * COUNTED_PROMPT_MARGIN_PERCENT // PERCENT)
    return min(byte_bound, counted_tokens + margin)


def countable(kind: str, forwarded: dict) -> bool:
    """Chat messages and a text prompt; a prompt of token ids is its own count."""
    if kind == CHAT:
        return isinstance(forwarded.get("messages"), list)
    return isinstance(_completion_prompt(forwarded.get("prompt")), str)


def prompt_key(model: str, kind: str, forwarded: dict) -> bytes:
    """A digest of everything of the request a template may render."""
    fields = {name: forwarded[name] for name in PROMPT_FIELDS if name in forwarded}
    encoded = orjson.dumps([model, kind, fields], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(encoded, digest_size=TOKENIZE_KEY_BYTES).digest()


class PromptCounter:
    def __init__(self, upstream: UpstreamPool, *, timeout_s: float = TOKENIZE_TIMEOUT_S) -> None:
        self.upstream = upstream
        self.timeout_s = timeout_s
        self._counts: OrderedDict[bytes, Counted] = OrderedDict()  # least recently used first
        self._asker: dict[str, int] = {}  # model -> the worker that last answered
        self._distrusted: dict[str, int] = {}  # model -> the worker whose count proved too low, asked last

    async def count(self, model: str, kind: str, forwarded: dict, fleet: list[registry.WorkerView],
                    *, excluding: int | None = None) -> Counted | None:
        """The prompt's tokens as a worker of the model counts them; None when
        no worker answered (the byte bound then routes, as without a count).
        `excluding` asks for another worker's opinion, past the cache."""
        key = prompt_key(model, kind, forwarded)
        cached = self._counts.get(key)
        if cached is not None and excluding is None:
            self._counts.move_to_end(key)
            return cached
        for worker in self._askable(model, fleet, excluding)[:TOKENIZE_WORKERS_ASKED_MAX]:
            tokens = await self._ask(worker, kind, forwarded)
            if tokens is None:
                continue
            counted = Counted(tokens, worker.id)
            if cached is None or counted.tokens < cached.tokens:  # a second opinion lowers a count, never raises it
                self._asker[model] = worker.id
                self._remember(key, counted)
            return counted
        return None

    def distrust(self, model: str, kind: str, forwarded: dict) -> None:
        """A worker refused as too long a prompt that its count said fits: forget
        the count, and ask another worker first from now on."""
        counted = self._counts.pop(prompt_key(model, kind, forwarded), None)
        if counted is not None:
            self._distrusted[model] = counted.worker_id
            if self._asker.get(model) == counted.worker_id:
                del self._asker[model]

    def _remember(self, key: bytes, counted: Counted) -> None:
        self._counts[key] = counted
        self._counts.move_to_end(key)
        while len(self._counts) > TOKENIZE_CACHE_ENTRIES_MAX:
            self._counts.popitem(last=False)

    def _askable(self, model: str, fleet: list[registry.WorkerView], excluding: int | None) -> list[registry.WorkerView]:
        """Routable workers: the one that answered last first, then the largest
        contexts (the workers a long prompt goes to), a distrusted one last."""
        asker, distrusted = self._asker.get(model), self._distrusted.get(model)
        routable = [w for w in fleet if w.state == "active" and w.healthy and w.id != excluding]
        return sorted(routable, key=lambda w: (w.id == distrusted, w.id != asker, -(w.context_length or 0), w.id))

    async def _ask(self, worker: registry.WorkerView, kind: str, forwarded: dict) -> int | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                if worker.engine == "llamacpp":
                    return await self._ask_llamacpp(worker, kind, forwarded)
                return await self._ask_vllm(worker, kind, forwarded)
        except TimeoutError:
            return None

    async def _ask_vllm(self, worker: registry.WorkerView, kind: str, forwarded: dict) -> int | None:
        body: dict = {"model": worker.served_model or worker.model}
        if kind == CHAT:
            body.update(messages=forwarded["messages"], add_generation_prompt=True)
            if forwarded.get("tools"):
                body["tools"] = forwarded["tools"]
        else:
            body["prompt"] = _completion_prompt(forwarded.get("prompt"))
        answer = await self._post(worker.url + "/tokenize", body)
        if not isinstance(answer, dict):
            return None
        count = answer.get("count")
        if count is None and isinstance(answer.get("tokens"), list):
            count = len(answer["tokens"])
        return _tokens(count)

    async def _ask_llamacpp(self, worker: registry.WorkerView, kind: str, forwarded: dict) -> int | None:
        prompt = _completion_prompt(forwarded.get("prompt"))
        if kind == CHAT:
            template: dict = {"messages": forwarded["messages"]}
            if forwarded.get("tools"):
                template["tools"] = forwarded["tools"]
            rendered = await self._post(worker.url + "/apply-template", template)
            prompt = rendered.get("prompt") if isinstance(rendered, dict) else None
            if not isinstance(prompt, str):
                return None
        answer = await self._post(worker.url + "/tokenize", {"content": prompt, "add_special": True})
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return len(tokens) if isinstance(tokens, list) else None

    async def _post(self, url: str, body: dict) -> object | None:
        response = None
        try:
            response = await self.upstream.post(url, orjson.dumps(body))
            if response.status != 200:
                return None
            return orjson.loads(await response.read())
        except (UpstreamError, ValueError):
            return None
        finally:
            if response is not None:
                response.close()


def _completion_prompt(prompt: object) -> object:
    """A prompt list of one string is that string."""
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt[0]
    return prompt


def _tokens(count: object) -> int | None:
    return count if type(count) is int and count >= 0 else None
