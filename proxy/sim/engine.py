"""The simulated GPU: which requests run, how long each token takes, what the
prefix cache holds, and the words it generates.

Timing (see proxy/sim/profiles.py): requests beyond max_num_seqs, or whose
prompt and answer the KV cache cannot hold next to the running ones, wait; a
running request pays prefill for its uncached prompt tokens, then decodes at a
rate that depends on how many requests are running. Deadlines are absolute so
pacing does not drift; `time_scale` divides every delay. A client disconnect
stops generation at once.

Generated text: one pseudo-word per token, each with a leading space
(" lorem"), the same sequence for every request of an engine built with the
same seed.
"""
from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

import orjson

from proxy.limits import (
    SIM_INSTANT_YIELD_EVERY_TOKENS,
    SIM_KV_BLOCK_TOKENS,
    SIM_PREFIX_BLOCK_BYTES,
    SIM_PREFIX_CACHE_BLOCKS_MAX,
    SIM_WORD_STEP,
)
from proxy.sim.profiles import SimProfile

WORDS = (
    "lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
    "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "enim",
    "ad", "minim", "veniam", "quis", "nostrud", "exercitation", "ullamco", "laboris", "nisi", "aliquip",
    "ex", "ea", "commodo", "consequat", "duis", "aute", "irure", "in", "reprehenderit", "voluptate",
    "velit", "esse", "cillum", "fugiat", "nulla", "pariatur", "excepteur", "sint", "occaecat", "cupidatat",
    "non", "proident", "sunt", "culpa", "qui", "officia", "deserunt", "mollit", "anim", "id", "est",
)  # fmt: skip


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


class SimulatedCrash(Exception):
    """Raised to drop a stream mid-way, like a worker process dying."""


class Emitter(Protocol):
    """Where a request's tokens go (proxy/sim/emitters.py)."""

    async def token(self, index: int, word: str, word_json: bytes) -> None: ...

    async def finish(self, completion_tokens: int, text: str) -> None: ...


def chat_cache_bytes(role: bytes, content: bytes) -> bytes:
    """A chat message as the prefix cache sees it."""
    return role + b"\x00" + content + b"\x00"


class SlotQueue:
    """At most max_running requests run, and only while the KV cache holds
    what they reserve (prompt and answer, as vLLM's scheduler admits a
    request only when its blocks fit); the rest wait in arrival order."""

    def __init__(self, max_running: int, kv_capacity_tokens: float = math.inf) -> None:
        self.max_running = max_running
        self.kv_capacity_tokens = kv_capacity_tokens
        self.running = 0
        self.waiting = 0
        self.kv_reserved_tokens = 0
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()

    def _fits(self, kv_tokens: int) -> bool:
        """A request alone always runs: the worker refused what its context cannot hold."""
        if self.running >= self.max_running:
            return False
        return self.running == 0 or self.kv_reserved_tokens + kv_tokens <= self.kv_capacity_tokens

    def _take(self, kv_tokens: int) -> None:
        self.running += 1
        self.kv_reserved_tokens += kv_tokens

    def try_acquire(self, kv_tokens: int = 0) -> bool:
        if not self._waiters and self._fits(kv_tokens):  # nobody overtakes a waiting request
            self._take(kv_tokens)
            return True
        return False

    def enqueue(self, loop: asyncio.AbstractEventLoop, kv_tokens: int = 0) -> asyncio.Future:
        waiter = loop.create_future()
        self._waiters.append((waiter, kv_tokens))
        return waiter

    def release(self, kv_tokens: int = 0) -> None:
        """A request ended: admit the waiters at the head that now fit."""
        self.running -= 1
        self.kv_reserved_tokens -= kv_tokens
        while self._waiters:
            waiter, wanted = self._waiters[0]
            if waiter.done():  # its client left
                self._waiters.popleft()
            elif self._fits(wanted):
                self._waiters.popleft()
                self._take(wanted)
                waiter.set_result(True)
            else:
                return


class PrefixCache:
    """LRU of chained hashes of whole prompt blocks, like vLLM's block hashes."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def cached_bytes(self, data: bytes) -> int:
        chain_hash = 0
        for start in range(0, len(data) - SIM_PREFIX_BLOCK_BYTES + 1, SIM_PREFIX_BLOCK_BYTES):
            chain_hash = hash((chain_hash, data[start : start + SIM_PREFIX_BLOCK_BYTES]))
            if chain_hash not in self._blocks:
                return start
            self._blocks.move_to_end(chain_hash)
        return len(data) - len(data) % SIM_PREFIX_BLOCK_BYTES

    def insert(self, data: bytes) -> None:
        chain_hash = 0
        for start in range(0, len(data) - SIM_PREFIX_BLOCK_BYTES + 1, SIM_PREFIX_BLOCK_BYTES):
            chain_hash = hash((chain_hash, data[start : start + SIM_PREFIX_BLOCK_BYTES]))
            self._blocks[chain_hash] = None
            self._blocks.move_to_end(chain_hash)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


class EngineState:
    """Counters a test or the /metrics endpoint reads."""

    def __init__(self, max_running: int, kv_capacity_tokens: float = math.inf) -> None:
        self.slots = SlotQueue(max_running, kv_capacity_tokens)
        self.requests_started = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.requests_failed = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0
        self.prefill_seconds_total = 0.0  # scheduled prefill time: what the prefix cache saves, without a clock
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


class Engine:
    def __init__(self, profile: SimProfile, *, seed: int, time_scale: float) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.time_scale = time_scale
        self.state = EngineState(profile.max_num_seqs, profile.kv_cache_capacity_tokens)
        self._prefix_cache = PrefixCache(min(SIM_PREFIX_CACHE_BLOCKS_MAX, profile.kv_cache_capacity_tokens // SIM_KV_BLOCK_TOKENS))
        self._words = [" " + WORDS[(seed + i * SIM_WORD_STEP) % len(WORDS)] for i in range(len(WORDS))]
        self._words_json = [orjson.dumps(w)[1:-1] for w in self._words]
        self._token_interval_s = self._decode_intervals_s()

    def _decode_intervals_s(self) -> list[float]:
        """Seconds per token for each number of running requests (index)."""
        if not self.profile.paced:
            return []
        rates = (self.profile.per_request_tok_s(n) for n in range(self.profile.max_num_seqs + 1))
        return [1.0 / (rate * self.time_scale) for rate in rates]

    def kv_cache_usage(self) -> float:
        """The share of the KV cache in use, as vLLM reports it (1 is full)."""
        return min(1.0, self.state.kv_tokens_in_use / self.profile.kv_cache_capacity_tokens)

    async def generate(self, request: GenerationRequest, call: Call, emitter: Emitter) -> None:
        """Wait for a slot, prefill, decode on schedule, then finish the answer
        (unless the client left)."""
        slots, kv_tokens = self.state.slots, request.prompt_tokens + request.completion_tokens
        if not slots.try_acquire(kv_tokens) and not await self._wait_for_slot(call, kv_tokens):
            return
        self.state.kv_tokens_in_use += request.prompt_tokens
        try:
            await self._decode(request, call, emitter)
        finally:
            generated = call.tokens_generated
            self.state.kv_tokens_in_use -= request.prompt_tokens + generated
            slots.release(kv_tokens)
            self._prefix_cache.insert(request.prompt_bytes + self._output_cache_bytes(request, generated))
        if not call.disconnected:
            await emitter.finish(generated, self.text_of(generated))

    async def _wait_for_slot(self, call: Call, kv_tokens: int) -> bool:
        slots = self.state.slots
        waiter = slots.enqueue(call.loop, kv_tokens)
        slots.waiting += 1
        granted = False
        try:
            granted = await call.wait(waiter)
        finally:
            slots.waiting -= 1
            holds_slot = waiter.done() and not waiter.cancelled() and waiter.result() is True
            if holds_slot and (call.disconnected or not granted):
                slots.release(kv_tokens)  # handed a slot just as the client left
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
        prefill_s = (prompt_tokens - cached_tokens) / (self.profile.prefill_tok_s * self.time_scale)
        self.state.prefill_seconds_total += prefill_s
        return prefill_s

    async def _decode(self, request: GenerationRequest, call: Call, emitter: Emitter) -> None:
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
            elif index % SIM_INSTANT_YIELD_EVERY_TOKENS == SIM_INSTANT_YIELD_EVERY_TOKENS - 1:
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
        return chat_cache_bytes(b"assistant", text) if request.chat else text
