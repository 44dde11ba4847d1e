"""Health checks: each proxy replica probes every worker it may route to.

A successful probe is the worker's heartbeat (health columns only: it never
touches state, so it cannot undo a drain). A draining worker becomes `drained`
once it reports nothing running or waiting, or at the 120 s deadline. Each
probe's scrape of the worker's /metrics is also what its load and its
capacity are measured from (proxy/capacity.py), and its prefix-cache
counters are written with the heartbeat, for its owner to see. A healthy
worker whose probe times out keeps its health until it has timed out
HEALTH_TIMEOUTS_IN_A_ROW_MAX times in a row: a loaded worker answers late,
a dead one refuses."""
from __future__ import annotations

import asyncio
import time

import httpx

from ledger.money import PERCENT
from ledger.schema import utc_now
from proxy import capacity
from proxy import workers as registry
from proxy.directory import Directory, WorkerLoad
from proxy.limits import (CAPACITY_PERIOD_S, CAPACITY_WINDOW_PERCENT_MIN, HEALTH_INTERVAL_S, HEALTH_PROBE_TIMEOUT_S,
                          HEALTH_TIMEOUTS_IN_A_ROW_MAX)


def context_from_models(payload: dict) -> tuple[int | None, str | None]:
    """(context length, served model name) from a vLLM worker's /v1/models."""
    data = payload.get("data") or []
    if not data:
        return None, None
    entry = data[0]
    context = entry.get("max_model_len")
    return (int(context) if isinstance(context, int) and context > 0 else None), entry.get("id")


def _prefix_cache(probe: dict) -> tuple[int | None, int | None] | None:
    """What a healthy worker's metrics said of its prefix cache (None, None when nothing);
    an unhealthy one's last figures stay."""
    if not probe["healthy"]:
        return None
    metrics = probe.get("metrics") or capacity.WorkerMetrics()
    hits, queries = metrics.prefix_cache_hits, metrics.prefix_cache_queries
    return (None, None) if hits is None or queries is None else (int(hits), int(queries))


class HealthChecker:
    def __init__(self, directory: Directory, client: httpx.AsyncClient, *, interval_s: float = HEALTH_INTERVAL_S,
                 period_s: float = CAPACITY_PERIOD_S) -> None:
        self.directory = directory
        self.client = client
        self.interval_s = interval_s
        self.period_s = period_s  # of capacity measurements
        self.timeouts_in_a_row: dict[int, int] = {}  # by worker id, on this replica

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # one bad round must not stop health checking
                pass
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        fleet = [w for ws in self.directory.fleet.values() for w in ws if w.state != "drained"]
        results = await asyncio.gather(*(self.probe(w) for w in fleet))
        now_s = time.monotonic()
        for worker, probe in zip(fleet, results):  # on the loop's thread, like every change of a load
            probe["healthy"] = self._health(worker, probe)
            self.directory.load(worker.id).scraped(probe.get("metrics") or capacity.WorkerMetrics(), now_s,
                                                   answered=probe["healthy"], relayed_by_all=worker.relayed_tokens_total)
        await asyncio.to_thread(self._record, list(zip(fleet, results)), now_s)
        await self.directory.refresh_async()

    async def probe(self, worker: registry.WorkerView) -> dict:
        try:
            if worker.engine == "llamacpp":
                return await self._probe_llamacpp(worker)
            health = await self.client.get(worker.url + "/health", timeout=HEALTH_PROBE_TIMEOUT_S)
            models = await self.client.get(worker.url + "/v1/models", timeout=HEALTH_PROBE_TIMEOUT_S)
            if health.status_code != 200 or models.status_code != 200:
                return {"healthy": False}
            context, served = context_from_models(models.json())
            metrics = await self.client.get(worker.url + "/metrics", timeout=HEALTH_PROBE_TIMEOUT_S)
            scraped = capacity.parse_metrics(metrics.text) if metrics.status_code == 200 else capacity.WorkerMetrics()
            return {"healthy": True, "context_length": context, "served_model": served, "metrics": scraped}
        except httpx.TimeoutException:
            return {"healthy": False, "timed_out": True}
        except (httpx.HTTPError, ValueError):
            return {"healthy": False}

    def _health(self, worker: registry.WorkerView, probe: dict) -> bool | None:
        """What to record: None (health unchanged) for a healthy worker's first
        timeouts in a row, else what the probe found."""
        timeouts = self.timeouts_in_a_row.get(worker.id, 0) + 1 if probe.get("timed_out") else 0
        self.timeouts_in_a_row[worker.id] = timeouts
        if worker.healthy and 0 < timeouts < HEALTH_TIMEOUTS_IN_A_ROW_MAX:
            return None
        return probe["healthy"]

    async def _probe_llamacpp(self, worker: registry.WorkerView) -> dict:
        """llama-cpp-python's server has no /health, and every model endpoint
        waits for (or interrupts) the one request it runs at a time: any answer
        from the server proves it is up, and the context length comes from
        registration."""
        response = await self.client.get(worker.url + "/health", timeout=HEALTH_PROBE_TIMEOUT_S)
        return {"healthy": response.status_code < 500}

    def _record(self, probes: list[tuple[registry.WorkerView, dict]], now_s: float) -> None:
        now = utc_now()
        relayed = {worker.id: self.directory.load(worker.id).unflushed() for worker, _ in probes}
        with self.directory.engine.begin() as conn:
            for worker, probe in probes:
                registry.record_heartbeat(conn, worker.id, healthy=probe["healthy"], context_length=probe.get("context_length"),
                                          served_model=probe.get("served_model"), relayed_tokens=relayed[worker.id],
                                          prefix_cache=_prefix_cache(probe))
                load = self.directory.load(worker.id)
                if worker.state == "draining" and (registry.drain_overdue(worker, now) or self._idle(worker, probe)):
                    registry.mark_drained(conn, worker.id)
                self._measure(conn, worker, load, now, now_s)
        for worker, _ in probes:  # committed: those tokens are in every replica's total now
            self.directory.load(worker.id).relayed_flushed += relayed[worker.id]

    def _measure(self, conn, worker: registry.WorkerView, load: WorkerLoad, now, now_s: float) -> None:
        """Once per period, the worker's capacity from the period's scrapes;
        whichever replica comes first writes it, and every replica reads it."""
        if worker.capacity_measured_at is not None and (now - worker.capacity_measured_at).total_seconds() < self.period_s:
            return
        scrapes = load.period(now_s, self.period_s)
        if not scrapes or (scrapes[-1].at_s - scrapes[0].at_s) * PERCENT < self.period_s * CAPACITY_WINDOW_PERCENT_MIN:
            return
        seen = capacity.observe(scrapes)
        current = capacity.Capacity(worker.throughput_tokens_per_s, worker.capacity_saturated, worker.capacity_requests)
        updated = capacity.next_capacity(current, seen) if seen is not None else None
        if updated is not None:
            registry.record_capacity(conn, worker, updated, now)

    def _idle(self, worker: registry.WorkerView, probe: dict) -> bool:
        local = self.directory.loads.get(worker.id)
        in_flight_here = local.in_flight if local else 0
        reported = (probe.get("metrics") or capacity.WorkerMetrics()).busy
        return in_flight_here == 0 and (reported == 0 or (reported is None and probe["healthy"]))
