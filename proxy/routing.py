"""Which worker serves a request: pure functions over a snapshot of the fleet.

1. Candidates: serving the model, active, healthy, with a context that holds
   the prompt bound plus max_tokens. The bound is the byte bound, or near a
   context limit the engine's own count plus a margin (proxy/tokenize.py);
   a worker's own "too long" is retried only on a larger context (`larger`).
2. Affinity: weighted rendezvous hashing of the conversation prefix, so every
   proxy replica picks the same worker for a follow-up without talking to the
   others (the worker that holds its KV cache answers ~5x sooner).
3. Spill: walk the rendezvous order past workers that are full: their own
   queue grows (vLLM's num_requests_waiting), or they run the batch they ran
   when last saturated. Weights and batches are the capacity every replica
   agreed on (proxy/capacity.py); a worker not measured yet is probed.
4. Long prompts (LONG_PROMPT_TOKENS_MIN and more) are weighed by the KV
   cache each worker has left, and the few workers that alone hold the
   longest ones keep some room free of short traffic (`reserved`).
"""
from __future__ import annotations

import hashlib
import math
import random
import statistics
from dataclasses import dataclass
from typing import NamedTuple

import orjson

from ledger.money import PERCENT
from proxy import workers as registry
from proxy.errors import ContextTooLong, NoWorkerAvailable
from proxy.limits import (
    AFFINITY_KEY_BYTES,
    AFFINITY_PREFIX_BYTES_MAX,
    AFFINITY_PROMPT_HEAD_BYTES,
    BATCH_TOKENS_PER_S_PER_REQUEST_MIN,
    KV_CACHE_CONTEXTS_MAX,
    LONG_PROMPT_RESERVE_PERCENT,
    LONG_PROMPT_TOKENS_MIN,
    PROBE_WEIGHT_TOKENS_PER_S,
    RENDEZVOUS_HASH_BYTES,
    RENDEZVOUS_HASH_SPAN,
    THROUGHPUT_STEP_RATIO,
    TOKENS_PER_S_PER_REQUEST_MIN,
    WORKER_ID_BYTES,
)


SPILL_QUEUE = "queue"  # the affinity choice reported requests waiting
SPILL_BUSY = "busy"  # it runs as many requests as its measured batch
SPILL_RESERVED = "reserved"  # short traffic left room on it for long prompts
SPILL_ALL_FULL = "all_full"  # every candidate was full: the least loaded for its size won


# The router, and two baselines it is measured against (benchmarks/fleet.py).
AFFINITY, RANDOM, ROUND_ROBIN = "affinity", "random", "round_robin"
POLICIES = (AFFINITY, RANDOM, ROUND_ROBIN)


def baseline_order(policy: str, candidates: list[registry.WorkerView], turn: int) -> list[registry.WorkerView]:
    """A baseline's order: uniformly random, or the next worker in turn."""
    if policy == RANDOM:
        return random.sample(candidates, len(candidates))
    by_id = sorted(candidates, key=lambda w: w.id)
    start = turn % len(by_id)
    return by_id[start:] + by_id[:start]


class WorkerLoadView(NamedTuple):
    """What a replica knows of one worker's load at this moment."""
    busy_requests: int  # running and waiting: the larger of this replica's count and the worker's last report
    waiting_requests: int  # the worker's own queue at its last scrape
    free_kv_tokens: int | None  # room left in its KV cache, when its metrics say
    kv_capacity_tokens: int | None = None  # its whole KV cache, when its metrics say


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: int
    weight: float  # rendezvous weight: capacity tokens/s (a probe when unmeasured), or free KV for a long prompt
    capacity_requests: int  # its measured batch, or for a worker not measured the most it is sent before its queue must speak
    size_requests: int  # its share of the load when everyone is full
    busy: int
    waiting: int = 0
    reserved_requests: int = 0  # of its measured batch, kept free for long prompts: short requests see it full this much earlier

    def full(self) -> str | None:
        """Why a new request should not go here, or None."""
        if self.waiting > 0:
            return SPILL_QUEUE
        if self.busy >= self.capacity_requests:
            return SPILL_BUSY
        if self.reserved_requests and self.busy >= self.capacity_requests - self.reserved_requests:
            return SPILL_RESERVED
        return None


class Size(NamedTuple):
    weight: float  # tokens/s, quantised
    capacity_requests: int  # the most requests it is sent before it counts as full
    size_requests: int  # its share of the load when everyone is full
    batch_measured: bool = False  # capacity_requests is the batch it ran at saturation


class Placement(NamedTuple):
    workers: list[registry.WorkerView]  # in the order to try
    spill: str | None  # why the first is not the affinity choice, None when it is


def candidates(fleet: list[registry.WorkerView], tokens_needed: int) -> list[registry.WorkerView]:
    """The workers that may serve a request needing this many tokens of context."""
    routable = [w for w in fleet if w.state == "active" and w.healthy]
    if not routable:
        raise NoWorkerAvailable("no worker is available for this model right now")
    fits = [w for w in routable if w.context_length is None or w.context_length >= tokens_needed]
    if not fits:
        largest = max(w.context_length for w in routable)
        raise ContextTooLong(
            f"This model's maximum context length is {largest} tokens; the request may need up to {tokens_needed}",
            param="messages",
        )
    return fits


def holds_everywhere(fleet: list[registry.WorkerView], tokens_needed: int) -> bool:
    """Every routable worker's context holds this many tokens (or has not told
    its size): the byte bound routes as well as a count would, so nothing is counted."""
    return all(w.context_length is None or w.context_length >= tokens_needed
               for w in fleet if w.state == "active" and w.healthy)


def larger(worker: registry.WorkerView, refused_context_length: int | None) -> bool:
    """May this worker serve a prompt that a worker of the refused context
    length found too long? Only a larger context, or one not told."""
    if refused_context_length is None or worker.context_length is None:
        return True
    return worker.context_length > refused_context_length


def worker_max_tokens(max_tokens: int, prompt_bound: int, context_length: int | None) -> int:
    """max_tokens as sent to one worker: the request's, at most the room its own
    context leaves after the prompt bound (a smaller worker than the largest
    candidate, whose room the request's max_tokens was planned on)."""
    if context_length is None:
        return max_tokens
    return max(1, min(max_tokens, context_length - prompt_bound))


def order(key: bytes, fleet: list[registry.WorkerView], loads: dict[int, WorkerLoadView], *,
          needed_tokens: int = 0, reserved: frozenset[int] = frozenset()) -> Placement:
    """The candidates in the order to try them (`choose`). A long prompt is
    placed by the room each worker's KV cache has left (`long_prompt_weights`);
    other requests by measured capacity, and keep `reserved` workers' spare
    room for the long prompts only they hold."""
    sizes = weights(fleet, {w.id: loads[w.id].kv_capacity_tokens for w in fleet})
    long_prompt = needed_tokens >= LONG_PROMPT_TOKENS_MIN
    kv = long_prompt_weights(fleet, loads, needed_tokens) if long_prompt else {}
    ranked = choose(key, [
        Candidate(w.id, kv.get(w.id, sizes[w.id].weight), sizes[w.id].capacity_requests, sizes[w.id].size_requests,
                  loads[w.id].busy_requests, loads[w.id].waiting_requests,
                  _reserve(sizes[w.id]) if w.id in reserved and not long_prompt else 0)
        for w in fleet])
    by_id = {w.id: w for w in fleet}
    return Placement([by_id[c.worker_id] for c in ranked.order], ranked.spill)


def _reserve(size: Size) -> int:
    """A share of a measured batch; a worker whose batch is not known yet is
    not held back (a guess would hold it back far below what it can run)."""
    if not size.batch_measured:
        return 0
    return max(1, size.capacity_requests * LONG_PROMPT_RESERVE_PERCENT // PERCENT)


def long_prompt_weights(fleet: list[registry.WorkerView], loads: dict[int, WorkerLoadView], needed_tokens: int) -> dict[int, float]:
    """Rendezvous weights for a long prompt: the KV cache each worker would
    have left after taking it, so it goes where it costs the fleet least and
    its follow-ups still find it. A worker without that room (it would queue
    the prompt or preempt others) is tried only after every worker with room.
    What a worker says of its cache counts up to KV_CACHE_CONTEXTS_MAX
    of its contexts, so a claim of a huge cache wins it only so many long prompts."""
    room = {}
    for worker in fleet:
        free = loads[worker.id].free_kv_tokens
        if free is None:  # no KV metrics: a worker holding this context holds at least that much cache
            free = worker.context_length or needed_tokens
        else:
            free = _believed_kv_tokens(worker, free)
        room[worker.id] = free - needed_tokens
    if any(left >= 0 for left in room.values()):
        return {worker_id: float(left) if left >= 0 else 0.0 for worker_id, left in room.items()}
    return {worker_id: float(max(1, left + needed_tokens)) for worker_id, left in room.items()}


def affinity_key(model: str, body: dict) -> bytes:
    """What a conversation's follow-ups share: for chat, the messages up to and
    including the first user message; for completions, the prompt's start."""
    messages = body.get("messages")
    if isinstance(messages, list):
        prefix = []
        for message in messages:
            prefix.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        head = orjson.dumps(prefix, option=orjson.OPT_SORT_KEYS)
    else:
        head = _prompt_head(body.get("prompt"))
    return hashlib.blake2b(model.encode() + b"\0" + head[:AFFINITY_PREFIX_BYTES_MAX], digest_size=AFFINITY_KEY_BYTES).digest()


def _prompt_head(prompt: object) -> bytes:
    """A completion prompt's head: what a continued prompt shares with the original."""
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
    return (prompt if isinstance(prompt, str) else "").encode()[:AFFINITY_PROMPT_HEAD_BYTES]


def _unit_hash(key: bytes, worker_id: int) -> float:
    """A uniform number in (0, 1), the same in every process."""
    digest = hashlib.blake2b(key + worker_id.to_bytes(WORKER_ID_BYTES, "big"), digest_size=RENDEZVOUS_HASH_BYTES).digest()
    return (int.from_bytes(digest, "big") + 1) / RENDEZVOUS_HASH_SPAN


def rendezvous_order(key: bytes, candidates: list[Candidate]) -> list[Candidate]:
    """Weighted rendezvous (highest random weight): worker i wins a key with
    probability weight_i / sum of weights, and removing a worker moves only
    the keys it held."""
    return sorted(candidates, key=lambda c: -c.weight / math.log(_unit_hash(key, c.worker_id)), reverse=True)


class Ranked(NamedTuple):
    order: list[Candidate]
    spill: str | None


def choose(key: bytes, candidates: list[Candidate]) -> Ranked:
    """Candidates in the order to try: the affinity choice first unless it is
    full (its queue grows, it runs its measured batch, or its spare room is
    kept for long prompts), then the rest of the rendezvous order (for
    retries). A worker of weight 0 (a long prompt would not fit its free KV
    cache) comes after every other."""
    ordered = rendezvous_order(key, [c for c in candidates if c.weight > 0])
    ordered += sorted((c for c in candidates if c.weight <= 0), key=lambda c: c.busy / c.size_requests)
    free = [c for c in ordered if c.full() is None and c.weight > 0]
    if not free:  # everyone is full: the least loaded for its size first
        ranked = sorted(ordered, key=lambda c: (c.weight <= 0, c.busy / c.size_requests))
        return Ranked(ranked, None if ranked[0] is ordered[0] else SPILL_ALL_FULL)
    ranked = free + [c for c in ordered if c not in free]
    return Ranked(ranked, None if ranked[0] is ordered[0] else ordered[0].full() or SPILL_ALL_FULL)


def quantise_tokens_per_s(tokens_per_s: float) -> int:
    """Round to a step of THROUGHPUT_STEP_RATIO so replicas that measured
    slightly differently still agree on weights (and so on affinity)."""
    if tokens_per_s <= 1:
        return 1
    return int(round(THROUGHPUT_STEP_RATIO ** round(math.log(tokens_per_s, THROUGHPUT_STEP_RATIO))))


def weights(fleet: list[registry.WorkerView], kv_capacity_tokens: dict[int, int | None] | None = None) -> dict[int, Size]:
    """Each worker's rendezvous weight and batch, from the capacity the
    replicas agreed on (proxy/capacity.py). A worker not yet measured at
    saturation is probed: weighed at least at the fleet's median capacity,
    scaled by the size of its KV cache against the fleet's (a card with ten
    times the cache takes about ten times the share of a burst before
    anything is measured), so it gets enough traffic to show what it can do.
    A batch is never more requests than would each decode at
    BATCH_TOKENS_PER_S_PER_REQUEST_MIN: a worker cannot claim (in its
    metrics) a batch its delivery does not show, and an unmeasured one is
    trusted to say itself (its queue) when it is full up to that many, and
    never fewer than the probe weight's."""
    saturated = [w.throughput_tokens_per_s for w in fleet if w.capacity_saturated and w.throughput_tokens_per_s]
    floors = [w.throughput_tokens_per_s for w in fleet if w.throughput_tokens_per_s]
    probe = statistics.median(saturated or floors) if (saturated or floors) else PROBE_WEIGHT_TOKENS_PER_S
    kv = _believed_kv(fleet, kv_capacity_tokens or {})
    kv_median = statistics.median(kv.values()) if kv else None
    out = {}
    for w in fleet:
        measured = w.throughput_tokens_per_s or 0
        batch_measured = bool(w.capacity_saturated and measured)
        if batch_measured:
            tokens_per_s = measured
        else:
            tokens_per_s = max(measured, probe * kv[w.id] / kv_median if w.id in kv else probe)
        weight = quantise_tokens_per_s(tokens_per_s)
        if batch_measured:
            ceiling = max(1, int(weight) // BATCH_TOKENS_PER_S_PER_REQUEST_MIN)
            capacity = min(w.capacity_requests, ceiling) if w.capacity_requests else ceiling
        else:  # never below the probe's: a quiet fleet's floors must not cut a worker off at a few requests
            capacity = max(int(weight), PROBE_WEIGHT_TOKENS_PER_S) // BATCH_TOKENS_PER_S_PER_REQUEST_MIN
        out[w.id] = Size(float(weight), capacity, capacity if batch_measured else max(1, int(weight) // TOKENS_PER_S_PER_REQUEST_MIN),
                         batch_measured)
    return out


def _believed_kv(fleet: list[registry.WorkerView], kv_capacity_tokens: dict[int, int | None]) -> dict[int, int]:
    return {w.id: _believed_kv_tokens(w, kv_capacity_tokens[w.id]) for w in fleet if kv_capacity_tokens.get(w.id)}


def _believed_kv_tokens(worker: registry.WorkerView, reported_tokens: int) -> int:
    """KV cache a worker reports (all of it, or what is free), believed up to KV_CACHE_CONTEXTS_MAX of its contexts."""
    if worker.context_length is None:
        return reported_tokens
    return min(reported_tokens, worker.context_length * KV_CACHE_CONTEXTS_MAX)
