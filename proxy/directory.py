"""What the hot path reads from memory instead of the database: prices, the
fleet, API keys. Refreshed in the background; a key lookup that misses goes
to the database once and is cached for a short time (revocation takes effect
within `key_cache_ttl_s`)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine

from proxy import keys, prices, workers

REFRESH_INTERVAL_S = 1.0
KEY_CACHE_TTL_S = 1.0
KEY_CACHE_ENTRIES_MAX = 100_000


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
        if tokens >= 2 and decode_s > 0:
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

    async def run(self, interval_s: float = REFRESH_INTERVAL_S) -> None:
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
        grant = await asyncio.to_thread(self._find_key, key)
        if len(self._keys) >= KEY_CACHE_ENTRIES_MAX:
            self._keys.clear()
        self._keys[key] = (now, grant)
        return grant

    def _find_key(self, key: str) -> keys.KeyGrant | None:
        with self.engine.connect() as conn:
            return keys.find_key(conn, key)

    def measured_tokens_per_s(self, worker: workers.WorkerView) -> int | None:
        """The measurement every replica shares (from the database), so that
        all of them weigh workers alike and agree on affinity."""
        return worker.throughput_tokens_per_s
