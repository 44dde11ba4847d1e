"""Performance profiles of the simulated worker, from public measurements.

Decode model: a request's decode rate falls as more requests share the GPU,

    per_request_tok_s(n) = single_request_tok_s / (1 + (n - 1) * k)

a smooth curve through (1, single) and (n_ref, total_ref / n_ref). Solving at
the reference point gives k = (single * n_ref / total_ref - 1) / (n_ref - 1).
Total throughput n * per_request_tok_s(n) then rises towards single / k, as a
batch-bound GPU does.

Prefill model: time to first token is the uncached prompt tokens divided by
`prefill_tok_s`, plus one decode step. A prefix-cache hit skips the cached part,
which is what makes a follow-up on the worker holding its conversation several
times faster (0.54 s against 2.56 s in the measurements behind DESIGN.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SimProfile:
    name: str
    single_request_tok_s: float
    reference_total_tok_s: float
    reference_concurrency: int
    max_num_seqs: int
    max_model_len_tokens: int
    prefill_tok_s: float
    kv_cache_capacity_tokens: int
    paced: bool = True  # False: no sleeping at all, for benchmarks of the proxy

    def __post_init__(self) -> None:
        if self.reference_concurrency < 2:
            raise ValueError(f"{self.name}: reference_concurrency must be at least 2")
        if self.reference_total_tok_s / self.reference_concurrency > self.single_request_tok_s:
            raise ValueError(f"{self.name}: a request cannot decode faster when sharing the GPU")
        if min(self.max_num_seqs, self.max_model_len_tokens, self.kv_cache_capacity_tokens) < 1:
            raise ValueError(f"{self.name}: limits must be positive")

    @property
    def slowdown_per_extra_request(self) -> float:
        """k in the decode model above."""
        n_ref = self.reference_concurrency
        return (self.single_request_tok_s * n_ref / self.reference_total_tok_s - 1) / (n_ref - 1)

    def per_request_tok_s(self, running: int) -> float:
        if not self.paced:
            return math.inf
        extra_requests = max(running, 1) - 1
        return self.single_request_tok_s / (1 + extra_requests * self.slowdown_per_extra_request)

    def total_tok_s(self, running: int) -> float:
        return max(running, 1) * self.per_request_tok_s(running)


PROFILES: dict[str, SimProfile] = {
    p.name: p
    for p in (
        SimProfile(
            name="h200",
            single_request_tok_s=170,
            reference_total_tok_s=3_300,
            reference_concurrency=128,
            max_num_seqs=256,
            max_model_len_tokens=262_144,
            prefill_tok_s=5_000,
            kv_cache_capacity_tokens=1_500_000,
        ),
        SimProfile(
            name="rtx-pro-6000",
            single_request_tok_s=106,
            reference_total_tok_s=1_342,
            reference_concurrency=32,
            max_num_seqs=64,
            max_model_len_tokens=131_072,
            prefill_tok_s=2_500,
            kv_cache_capacity_tokens=600_000,
        ),
        SimProfile(
            name="2x4090",
            single_request_tok_s=94,
            reference_total_tok_s=435,
            reference_concurrency=32,
            max_num_seqs=32,
            max_model_len_tokens=65_536,
            prefill_tok_s=1_200,
            kv_cache_capacity_tokens=150_000,
        ),
        SimProfile(
            name="2x5090",
            single_request_tok_s=150,
            reference_total_tok_s=1_318,
            reference_concurrency=32,
            max_num_seqs=64,
            max_model_len_tokens=131_072,
            prefill_tok_s=3_000,
            kv_cache_capacity_tokens=300_000,
        ),
        SimProfile(
            name="instant",
            single_request_tok_s=math.inf,
            reference_total_tok_s=math.inf,
            reference_concurrency=2,
            max_num_seqs=1_000_000,
            max_model_len_tokens=32_768,
            prefill_tok_s=math.inf,
            kv_cache_capacity_tokens=100_000_000,
            paced=False,
        ),
    )
}


def get_profile(name: str) -> SimProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
