"""How much each worker can deliver, measured from what it delivered, and
agreed by every proxy replica.

Every replica scrapes every worker's /metrics at each health check
(proxy/health.py). The worker's own counters count all of its traffic,
whichever replica sent it, so every replica sees the same numbers:

- output tokens delivered: vLLM's `vllm:generation_tokens` (llama.cpp's
  `llamacpp:tokens_predicted`), believed up to a margin above what every
  replica relayed from the worker (`relayed_tokens_total`, added at each
  health check), so an owner cannot win traffic by inflating the counter;
  without a counter, what the replicas relayed;
- requests running and waiting: `num_requests_running`, `num_requests_waiting`;
- the KV cache: `kv_cache_usage_perc` and `cache_config_info`'s blocks;
- the prefix cache: `prefix_cache_hits` and `prefix_cache_queries` (tokens,
  since the engine started; vLLM before 0.10 named them `gpu_prefix_cache_*`
  and later versions send both: one pair is read, never the sum), shown to
  the worker's owner and never used for routing.

A period's measurement (`observe`) is a measurement *at saturation* when the
worker queued requests through most of it: the tokens per second it
delivered then are its capacity, and the requests it ran its batch. Below
saturation the tokens per second are only a floor. `next_capacity` smooths
saturated measurements and only ever raises a capacity with a floor, so a
quiet period erases nothing. Once per period one replica writes the result
(`workers.record_capacity`: a compare-and-set on the time of the last
write), and every replica routes on that one stored value.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from ledger.money import PERCENT
from proxy.limits import CAPACITY_SATURATED_PERCENT_MIN, CAPACITY_SMOOTHING_PERCENT, RELAYED_TOKENS_MARGIN_PERCENT

RUNNING = frozenset({"vllm:num_requests_running", "llamacpp:requests_processing"})
WAITING = frozenset({"vllm:num_requests_waiting", "llamacpp:requests_deferred"})
# Counters: with a TYPE line the parser names the family without `_total`, without one with it.
GENERATED = frozenset({f"{name}{suffix}" for name in ("vllm:generation_tokens", "llamacpp:tokens_predicted")
                       for suffix in ("", "_total")})
KV_USAGE = "vllm:kv_cache_usage_perc"  # 0 to 1, despite its name
CACHE_CONFIG = "vllm:cache_config_info"  # labels num_gpu_blocks and block_size
# The prefix cache's counters, each family under its current name and its older one (in order of preference).
PREFIX_CACHE_NAMES = {"prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
                      "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")}
PREFIX_CACHE_FAMILIES = {f"{name}{suffix}": (field, rank) for field, names in PREFIX_CACHE_NAMES.items()
                         for rank, name in enumerate(names) for suffix in ("", "_total")}


class WorkerMetrics(NamedTuple):
    """One scrape of a worker's /metrics; None where the worker did not say."""
    running: int | None = None
    waiting: int | None = None
    generation_tokens: float | None = None
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    prefix_cache_hits: float | None = None  # tokens found in the prefix cache, since the engine started
    prefix_cache_queries: float | None = None  # prompt tokens looked up in it

    @property
    def busy(self) -> int | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0) + (self.waiting or 0)

    def free_kv_tokens(self) -> int | None:
        if self.kv_capacity_tokens is None:
            return None
        return int(self.kv_capacity_tokens * (1 - min(1.0, max(0.0, self.kv_usage or 0.0))))


def parse_metrics(text: str) -> WorkerMetrics:
    """The figures routing needs from a worker's Prometheus text, each summed
    over its label sets; nothing when the text does not parse."""
    sums: dict[str, float] = {}
    kv_capacity = None
    try:
        for family in text_string_to_metric_families(text):
            name = _field_of(family.name)
            if name is not None:
                for sample in family.samples:
                    if sample.name in (family.name, family.name + "_total"):
                        sums[name] = sums.get(name, 0.0) + sample.value
            elif family.name == CACHE_CONFIG:
                kv_capacity = _kv_capacity_tokens(family.samples) or kv_capacity
    except ValueError:  # not Prometheus text: the load is unknown, not zero
        return WorkerMetrics()
    as_int = {name: int(sums[name]) for name in ("running", "waiting") if name in sums}
    return WorkerMetrics(generation_tokens=sums.get("generation_tokens"), kv_usage=sums.get("kv_usage"),
                         kv_capacity_tokens=kv_capacity, **_prefix_cache(sums), **as_int)


def _prefix_cache(sums: dict[str, float]) -> dict[str, float]:
    """Hits and queries under the first naming that has both: a worker
    sending the old names beside the new ones is not counted twice."""
    for rank in range(len(PREFIX_CACHE_NAMES["prefix_cache_hits"])):
        pair = {field: sums.get(f"{field}:{rank}") for field in PREFIX_CACHE_NAMES}
        if None not in pair.values():
            return pair
    return {}


def _field_of(family_name: str) -> str | None:
    if family_name in RUNNING:
        return "running"
    if family_name in WAITING:
        return "waiting"
    if family_name in GENERATED:
        return "generation_tokens"
    if family_name == KV_USAGE:
        return "kv_usage"
    if family_name in PREFIX_CACHE_FAMILIES:
        field, rank = PREFIX_CACHE_FAMILIES[family_name]
        return f"{field}:{rank}"
    return None


def _kv_capacity_tokens(samples) -> int | None:
    for sample in samples:
        try:
            return int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
        except (KeyError, ValueError):
            continue
    return None


class Scrape(NamedTuple):
    at_s: float  # monotonic time of the scrape
    generation_tokens: float | None  # the worker's own counter; None when its metrics have none
    relayed_tokens: float  # what every replica relayed from it, as far as this replica knows
    running: int
    waiting: int


class Observation(NamedTuple):
    tokens_per_s: float  # delivered
    saturated: bool  # the worker queued requests through most of the period: this is its capacity
    batch_requests: int | None  # requests it ran while it queued


class Capacity(NamedTuple):
    tokens_per_s: int | None
    saturated: bool
    requests: int | None


def observe(scrapes: Sequence[Scrape]) -> Observation | None:
    """A period's scrapes, in order, as one measurement; None when they are too few."""
    everything, queued = _Delivery(), _Delivery()
    batch = 0
    for before, after in pairwise(scrapes):
        everything.add(before, after)
        if before.waiting > 0 and after.waiting > 0:  # queued from end to end: running its full batch
            queued.add(before, after)
            batch = max(batch, before.running, after.running)
    if everything.seconds <= 0:
        return None
    if queued.seconds > 0 and queued.seconds * PERCENT >= everything.seconds * CAPACITY_SATURATED_PERCENT_MIN:
        return Observation(queued.tokens_per_s(), True, batch or None)
    return Observation(everything.tokens_per_s(), False, None)


class _Delivery:
    """Tokens delivered over some intervals: by the worker's own count, and by the proxies'."""

    def __init__(self) -> None:
        self.counted = self.relayed = self.seconds = 0.0

    def add(self, before: Scrape, after: Scrape) -> None:
        relayed = max(0.0, after.relayed_tokens - before.relayed_tokens)
        counted = None
        if before.generation_tokens is not None and after.generation_tokens is not None:
            counted = after.generation_tokens - before.generation_tokens
        self.relayed += relayed
        self.counted += counted if counted is not None and counted >= 0 else relayed  # a restarted worker counts again from 0
        self.seconds += after.at_s - before.at_s

    def tokens_per_s(self) -> float:
        """The worker's count, but never more than a margin above what the
        proxies relayed: a worker cannot talk itself into more traffic."""
        believed = min(self.counted, self.relayed * (PERCENT + RELAYED_TOKENS_MARGIN_PERCENT) / PERCENT)
        return believed / self.seconds


def next_capacity(current: Capacity, seen: Observation) -> Capacity | None:
    """The capacity after this period's measurement; None when it stays."""
    delivered = max(1, round(seen.tokens_per_s))
    if seen.saturated:
        if not current.saturated or current.tokens_per_s is None:
            return Capacity(delivered, True, seen.batch_requests)
        return Capacity(_smooth(current.tokens_per_s, delivered), True,
                        _smooth(current.requests, seen.batch_requests) if current.requests else seen.batch_requests)
    if current.tokens_per_s is None or delivered > current.tokens_per_s:  # a floor only ever raises it
        return Capacity(delivered, current.saturated, current.requests)
    return None


def _smooth(current: int, seen: int | None) -> int:
    if seen is None:
        return current
    return max(1, (current * (PERCENT - CAPACITY_SMOOTHING_PERCENT) + seen * CAPACITY_SMOOTHING_PERCENT) // PERCENT)
