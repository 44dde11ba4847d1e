"""What the hot path reads from memory instead of the database: prices, the
fleet, API keys. Refreshed in the background; a key lookup that misses goes
to the database once and is cached for a short time. A revoked key is
forgotten at once: by the process that revoked it, and on PostgreSQL by every
other one when it hears the notification (proxy/revocations.py); the cache's
time to live is only the fallback for a notification that never came."""
from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Engine

from ledger.schema import utc_now
from proxy import keys, prices, routing, workers
from proxy.capacity import Scrape, WorkerMetrics
from proxy.limits import (
    DIRECTORY_REFRESH_INTERVAL_S,
    KEY_CACHE_ENTRIES_MAX,
    KEY_CACHE_TTL_S,
    LONG_PROMPT_RESERVE_RENEW_S,
    LONG_PROMPT_RESERVE_S,
    LONG_PROMPT_TOKENS_MIN,
    SCRAPES_KEPT_MAX,
)
from proxy.routing import WorkerLoadView
from proxy.schema import api_keys


@dataclass
class WorkerLoad:
    """This process's view of one worker's load (proxy/capacity.py)."""

    in_flight: int = 0  # requests this replica has on it
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)  # the worker's last scrape
    in_flight_at_scrape: int = 0
    relayed_tokens: int = 0  # output tokens this replica relayed from it (booked each second)
    relayed_flushed: int = 0  # of those, added to the worker's total of every replica
    scrapes: deque[Scrape] = field(default_factory=lambda: deque(maxlen=SCRAPES_KEPT_MAX))

    def busy(self) -> int:
        """Running and waiting: the worker's last report (all replicas' requests)
        moved by what this replica started and finished since."""
        return max(self.in_flight, (self.metrics.busy or 0) + self.in_flight - self.in_flight_at_scrape)

    def view(self) -> WorkerLoadView:
        return WorkerLoadView(self.busy(), self.metrics.waiting or 0, self.metrics.free_kv_tokens(),
                              self.metrics.kv_capacity_tokens)

    def unflushed(self) -> int:
        return self.relayed_tokens - self.relayed_flushed

    def scraped(self, metrics: WorkerMetrics, at_s: float, *, answered: bool = True, relayed_by_all: int = 0) -> None:
        """A new scrape, with what every replica relayed from the worker as far
        as this one knows: their shared total, and its own not added to it yet.
        A worker that did not answer adds nothing to measure."""
        self.metrics, self.in_flight_at_scrape = metrics, self.in_flight
        if not answered:
            return
        running = metrics.running if metrics.running is not None else self.in_flight
        self.scrapes.append(Scrape(at_s, metrics.generation_tokens, float(relayed_by_all + self.unflushed()), running,
                                   metrics.waiting or 0))

    def period(self, now_s: float, period_s: float) -> list[Scrape]:
        """The scrapes of the last period, one before it included, so the
        intervals cover the whole period."""
        scrapes = list(self.scrapes)
        inside = [i for i, s in enumerate(scrapes) if s.at_s >= now_s - period_s]
        return scrapes[max(0, inside[0] - 1):] if inside else []


@dataclass
class Directory:
    engine: Engine
    key_cache_ttl_s: float = KEY_CACHE_TTL_S
    prices: dict[str, prices.Price] = field(default_factory=dict)
    fleet: dict[str, list[workers.WorkerView]] = field(default_factory=dict)  # by public model name
    loads: dict[int, WorkerLoad] = field(default_factory=dict)
    routing_policy: str = routing.AFFINITY  # the others are baselines for benchmarks
    spills: Counter[tuple[str, str]] = field(default_factory=Counter)  # (model, reason): requests sent past their affinity choice
    # model -> the workers that alone held a recent long prompt, and until when they keep room for such prompts
    _reserved: dict[str, tuple[frozenset[int], datetime]] = field(default_factory=dict)
    _writing_room: bool = False  # a write of long_prompts_until is under way
    _turn: int = 0  # round robin's
    _keys: dict[str, tuple[float, keys.KeyGrant | None]] = field(default_factory=dict)
    _secret_of_key: dict[int, str] = field(default_factory=dict)  # key id -> the cached secret, for revocations
    # Bumped by every eviction: a lookup that was in flight meanwhile may have
    # read the key before it was revoked, so its answer is not cached.
    _evictions: int = 0

    def _read(self) -> tuple:
        with self.engine.connect() as conn:
            new_prices = prices.load_prices(conn)
            fleet: dict[str, list[workers.WorkerView]] = {}
            for worker in workers.list_workers(conn):
                fleet.setdefault(worker.model, []).append(worker)
        return new_prices, fleet

    def _apply(self, snapshot: tuple) -> None:
        """On the event loop's thread, like everything else that touches this state."""
        self.prices, self.fleet = snapshot
        for fleet in self.fleet.values():
            for worker in fleet:
                self.loads.setdefault(worker.id, WorkerLoad())

    async def refresh_async(self) -> None:
        self._apply(await asyncio.to_thread(self._read))

    async def run(self, interval_s: float = DIRECTORY_REFRESH_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh_async()
            except Exception:  # a database blip must not stop the refresher; the last snapshot stays
                continue

    def worker(self, worker_id: int) -> workers.WorkerView | None:
        for fleet in self.fleet.values():
            for worker in fleet:
                if worker.id == worker_id:
                    return worker
        return None

    def models(self) -> list[str]:
        return sorted(m for m in self.prices if m in self.fleet)

    async def authenticate(self, key: str) -> keys.KeyGrant | None:
        now = time.monotonic()
        cached = self._keys.get(key)
        if cached is not None and now - cached[0] < self.key_cache_ttl_s:
            return cached[1]
        evictions = self._evictions
        grant = await asyncio.to_thread(self._find_key, key)
        if evictions == self._evictions:
            self._cache_key(key, now, grant)
        return grant

    def _cache_key(self, key: str, now: float, grant: keys.KeyGrant | None) -> None:
        if len(self._keys) >= KEY_CACHE_ENTRIES_MAX:
            self._keys.clear()
            self._secret_of_key.clear()
        self._keys[key] = (now, grant)
        if grant is not None:
            self._secret_of_key[grant.id] = key

    def evict_key(self, key_id: int) -> None:
        """The key was revoked: the next request with it reads the database."""
        self._evictions += 1
        secret = self._secret_of_key.pop(key_id, None)
        if secret is not None:
            self._keys.pop(secret, None)

    def forget_keys(self) -> None:
        """Revocations may have been missed: every key is read afresh."""
        self._evictions += 1
        self._keys.clear()
        self._secret_of_key.clear()

    def on_revoked(self, table_name: str, row_id: int) -> None:
        if table_name == api_keys.name:  # management tokens are never cached
            self.evict_key(row_id)

    def _find_key(self, key: str) -> keys.KeyGrant | None:
        with self.engine.connect() as conn:
            return keys.find_key(conn, key)

    def _keep_room(self, model: str, holders: list[workers.WorkerView], now: datetime) -> None:
        """Room on the workers that alone hold a long prompt: here at once, and
        written for the other replicas unless what they read still has a while to run."""
        until = now + timedelta(seconds=LONG_PROMPT_RESERVE_S)
        self._reserved[model] = (frozenset(w.id for w in holders), until)
        renew_after = now + timedelta(seconds=LONG_PROMPT_RESERVE_RENEW_S)
        if self._writing_room or all(w.long_prompts_until and w.long_prompts_until > renew_after for w in holders):
            return
        self._writing_room = True
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._write_room, [w.id for w in holders], until))
        task.add_done_callback(self._room_written)

    def _write_room(self, worker_ids: list[int], until: datetime) -> None:
        with self.engine.begin() as conn:
            workers.keep_room_for_long_prompts(conn, worker_ids, until)

    def _room_written(self, task: asyncio.Task) -> None:
        self._writing_room = False
        if not task.cancelled():
            task.exception()  # a database blip: the other replicas learn of the next long prompt instead

    def load(self, worker_id: int) -> WorkerLoad:
        return self.loads.setdefault(worker_id, WorkerLoad())

    def place(self, model: str, key: bytes, candidates: list[workers.WorkerView], needed_tokens: int) -> list[workers.WorkerView]:
        """The candidates in the order to try them (proxy/routing.py), from
        this replica's view of their load; a spill is counted for /metrics. A
        long prompt that only some workers hold keeps room on them, at once
        here and, through the database, on every replica."""
        if self.routing_policy != routing.AFFINITY:
            self._turn += 1
            return routing.baseline_order(self.routing_policy, candidates, self._turn)
        now = utc_now()
        if needed_tokens >= LONG_PROMPT_TOKENS_MIN and not routing.holds_everywhere(self.fleet.get(model, []), needed_tokens):
            self._keep_room(model, candidates, now)
        if len(candidates) == 1:  # nothing to order, and one worker never spills: its loads and weights need not be read
            return list(candidates)
        here, until = self._reserved.get(model, (frozenset(), now))
        reserved = frozenset(w.id for w in candidates if (w.long_prompts_until or now) > now or (w.id in here and until > now))
        placement = routing.order(key, candidates, {w.id: self.load(w.id).view() for w in candidates},
                                  needed_tokens=needed_tokens, reserved=reserved)
        if placement.spill is not None:
            self.spills[(model, placement.spill)] += 1
        return placement.workers
