"""Which worker serves a request: pure functions over a snapshot of the fleet.

1. Candidates: serving the model, active, healthy, with a context that holds
   the prompt bound plus max_tokens.
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

# Spill when a request on this worker would decode slower than this.
TOKENS_PER_S_PER_REQUEST_MIN = 20
# A worker with no measurement yet gets this capacity and the fleet's median
# weight, so it receives enough traffic to be measured (a probe period).
PROBE_CAPACITY_REQUESTS = 8
PROBE_WEIGHT_TOKENS_PER_S = 100
AFFINITY_PREFIX_BYTES_MAX = 16_384


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: int
    weight: float  # measured total tokens/s, or the probe weight
    capacity_requests: int
    in_flight: int


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
    return hashlib.blake2b(model.encode() + b"\0" + head[:AFFINITY_PREFIX_BYTES_MAX], digest_size=16).digest()


def _prompt_head(prompt: object) -> bytes:
    """A completion prompt's first KiB: what a continued prompt shares with the original."""
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
    return (prompt if isinstance(prompt, str) else "").encode()[:1024]


def _unit_hash(key: bytes, worker_id: int) -> float:
    """A uniform number in (0, 1), the same in every process."""
    digest = hashlib.blake2b(key + worker_id.to_bytes(8, "big"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 1) / (2**64 + 2)


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
    """Round to a step of about 19% so replicas that measured slightly
    differently still agree on weights (and so on affinity)."""
    if tokens_per_s <= 1:
        return 1
    step = 2 ** 0.25
    return int(round(step ** round(math.log(tokens_per_s, step))))


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
