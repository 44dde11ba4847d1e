"""What the hot path reads from memory instead of the database: prices, the
fleet, API keys. Refreshed in the background; a key lookup that misses goes
to the database once and is cached for a short time. A revoked key is
forgotten at once: by the process that revoked it, and on PostgreSQL by every
other one when it hears the notification (proxy/revocations.py); the cache's
time to live is only the fallback for a notification that never came."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine

from proxy import keys, prices, workers
from proxy.limits import DECODE_RATE_TOKENS_MIN, DIRECTORY_REFRESH_INTERVAL_S, KEY_CACHE_ENTRIES_MAX, KEY_CACHE_TTL_S
from proxy.schema import api_keys


@dataclass
class WorkerLoad:
    """This process's view of one worker's load and speed."""

    in_flight: int = 0
    reported_busy: int = 0  # running + waiting, from the worker's /metrics
    # Per-request decode rate x concurrency, the best seen since the last time
    # it was recorded: what the worker has shown it can deliver in total.
    peak_tokens_per_s: float = 0.0
    completed: int = 0
    recorded_at_s: float = field(default_factory=time.monotonic)  # start of the measuring period

    def busy(self) -> int:
        return max(self.in_flight, self.reported_busy)

    def observe(self, tokens: int, decode_s: float, concurrency: int) -> None:
        self.completed += 1
        if tokens >= DECODE_RATE_TOKENS_MIN and decode_s > 0:
            self.peak_tokens_per_s = max(self.peak_tokens_per_s, tokens / decode_s * max(1, concurrency))

    def start_new_period(self, now_s: float) -> None:
        self.peak_tokens_per_s, self.completed, self.recorded_at_s = 0.0, 0, now_s


@dataclass
class Directory:
    engine: Engine
    key_cache_ttl_s: float = KEY_CACHE_TTL_S
    prices: dict[str, prices.Price] = field(default_factory=dict)
    fleet: dict[str, list[workers.WorkerView]] = field(default_factory=dict)  # by public model name
    loads: dict[int, WorkerLoad] = field(default_factory=dict)
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

    def measured_tokens_per_s(self, worker: workers.WorkerView) -> int | None:
        """The measurement every replica shares (from the database), so that
        all of them weigh workers alike and agree on affinity."""
        return worker.throughput_tokens_per_s
