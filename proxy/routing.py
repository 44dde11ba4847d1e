"""Which worker serves a request: pure functions over a snapshot of the fleet.

1. Candidates: serving the model, active, healthy, with a context that holds
   the prompt bound plus max_tokens. The bound is the byte bound, or near a
   context limit the engine's own count plus a margin (proxy/tokenize.py);
   a worker's own "too long" is retried only on a larger context (`larger`).
2. Affinity: weighted rendezvous hashing of the conversation prefix, so every
   proxy replica picks the same worker for a follow-up without talking to the
   others (the worker that holds its KV cache answers ~5x sooner).
3. Spill: walk the rendezvous order past workers whose in-flight requests
   exceed their measured capacity.
"""
from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass

import orjson

from proxy import workers as registry
from proxy.errors import ContextTooLong, NoWorkerAvailable
from proxy.limits import (
    AFFINITY_KEY_BYTES,
    AFFINITY_PREFIX_BYTES_MAX,
    AFFINITY_PROMPT_HEAD_BYTES,
    PROBE_CAPACITY_REQUESTS,
    PROBE_WEIGHT_TOKENS_PER_S,
    RENDEZVOUS_HASH_BYTES,
    RENDEZVOUS_HASH_SPAN,
    THROUGHPUT_STEP_RATIO,
    TOKENS_PER_S_PER_REQUEST_MIN,
    WORKER_ID_BYTES,
)


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: int
    weight: float  # measured total tokens/s, or the probe weight
    capacity_requests: int
    in_flight: int


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


def order(key: bytes, fleet: list[registry.WorkerView], measured_tokens_per_s: dict[int, int | None],
          busy: dict[int, int]) -> list[registry.WorkerView]:
    """The candidates in the order to try them (`choose`), from each one's
    measured throughput and the requests it is busy with."""
    sizes = weights(measured_tokens_per_s)
    ranked = choose(key, [Candidate(w.id, sizes[w.id][0], sizes[w.id][1], busy[w.id]) for w in fleet])
    by_id = {w.id: w for w in fleet}
    return [by_id[c.worker_id] for c in ranked]


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


def choose(key: bytes, candidates: list[Candidate]) -> list[Candidate]:
    """Candidates in the order to try: the affinity choice first unless it is
    over capacity, then the rest of the rendezvous order (for retries)."""
    ordered = rendezvous_order(key, candidates)
    free = [c for c in ordered if c.in_flight < c.capacity_requests]
    if not free:  # everyone is busy: the least loaded for its size first
        return sorted(ordered, key=lambda c: c.in_flight / c.capacity_requests)
    return free + [c for c in ordered if c not in free]


def quantise_tokens_per_s(tokens_per_s: float) -> int:
    """Round to a step of THROUGHPUT_STEP_RATIO so replicas that measured
    slightly differently still agree on weights (and so on affinity)."""
    if tokens_per_s <= 1:
        return 1
    return int(round(THROUGHPUT_STEP_RATIO ** round(math.log(tokens_per_s, THROUGHPUT_STEP_RATIO))))


def weights(measured: dict[int, int | None]) -> dict[int, tuple[float, int]]:
    """(weight, capacity in requests) per worker from measured tokens/s; a
    worker without a measurement is probed at the fleet's median."""
    known = [v for v in measured.values() if v]
    probe = statistics.median(known) if known else PROBE_WEIGHT_TOKENS_PER_S
    out = {}
    for worker_id, tokens_per_s in measured.items():
        if tokens_per_s:
            out[worker_id] = (float(tokens_per_s), max(1, tokens_per_s // TOKENS_PER_S_PER_REQUEST_MIN))
        else:
            out[worker_id] = (float(probe), PROBE_CAPACITY_REQUESTS)
    return out
