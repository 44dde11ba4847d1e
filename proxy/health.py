"""Health checks: each proxy replica probes every worker it may route to.

A successful probe is the worker's heartbeat (health columns only: it never
touches state, so it cannot undo a drain). A draining worker becomes `drained`
once it reports nothing running or waiting, or at the 120 s deadline."""
from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ledger.schema import utc_now
from proxy import workers as registry
from proxy.directory import Directory, WorkerLoad
from proxy.limits import HEALTH_INTERVAL_S, HEALTH_PROBE_TIMEOUT_S, MEASURED_REQUESTS_MIN, WEIGHT_PERIOD_S
from proxy.routing import quantise_tokens_per_s

BUSY_METRICS = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting"})


def busy_from_metrics(text: str) -> int | None:
    """Running plus waiting requests from vLLM's Prometheus text (summed over
    their label sets), or None when the text has neither or does not parse."""
    total, seen = 0.0, False
    try:
        for family in text_string_to_metric_families(text):
            if family.name in BUSY_METRICS:
                for sample in family.samples:
                    total += sample.value
                    seen = True
    except ValueError:  # not Prometheus text: the load is unknown, not zero
        return None
    return int(total) if seen else None


def context_from_models(payload: dict) -> tuple[int | None, str | None]:
    """(context length, served model name) from a vLLM worker's /v1/models."""
    data = payload.get("data") or []
    if not data:
        return None, None
    entry = data[0]
    context = entry.get("max_model_len")
    return (int(context) if isinstance(context, int) and context > 0 else None), entry.get("id")


class HealthChecker:
    def __init__(self, directory: Directory, client: httpx.AsyncClient, *, interval_s: float = HEALTH_INTERVAL_S) -> None:
        self.directory = directory
        self.client = client
        self.interval_s = interval_s

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
        await asyncio.to_thread(self._record, list(zip(fleet, results)))
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
            busy = busy_from_metrics(metrics.text) if metrics.status_code == 200 else None
            return {"healthy": True, "context_length": context, "served_model": served, "busy": busy}
        except (httpx.HTTPError, ValueError):
            return {"healthy": False}

    async def _probe_llamacpp(self, worker: registry.WorkerView) -> dict:
        """llama-cpp-python's server has no /health, and every model endpoint
        waits for (or interrupts) the one request it runs at a time: any answer
        from the server proves it is up, and the context length comes from
        registration."""
        response = await self.client.get(worker.url + "/health", timeout=HEALTH_PROBE_TIMEOUT_S)
        return {"healthy": response.status_code < 500}

    def _record(self, probes: list[tuple[registry.WorkerView, dict]]) -> None:
        now = utc_now()
        with self.directory.engine.begin() as conn:
            for worker, probe in probes:
                registry.record_heartbeat(conn, worker.id, healthy=probe["healthy"],
                                          context_length=probe.get("context_length"), served_model=probe.get("served_model"))
                load = self.directory.loads.setdefault(worker.id, WorkerLoad())
                if probe.get("busy") is not None:
                    load.reported_busy = probe["busy"]
                if worker.state == "draining" and (registry.drain_overdue(worker, now) or self._idle(worker, probe)):
                    registry.mark_drained(conn, worker.id)
                self._record_throughput(conn, worker, load)

    @staticmethod
    def _record_throughput(conn, worker: registry.WorkerView, load: WorkerLoad) -> None:
        """Share a measurement once a new worker has served enough to be
        measured (the first replica to do so wins), then at most once per
        period and only when it moved by a step: every change of weight moves
        some conversations off the worker holding their cache."""
        if load.completed < MEASURED_REQUESTS_MIN or not load.peak_tokens_per_s:
            return
        now_s = time.monotonic()
        measured = quantise_tokens_per_s(load.peak_tokens_per_s)
        if worker.throughput_tokens_per_s is None:
            registry.record_throughput(conn, worker.id, measured, only_if_unmeasured=True)
        elif now_s - load.recorded_at_s >= WEIGHT_PERIOD_S and measured != worker.throughput_tokens_per_s:
            registry.record_throughput(conn, worker.id, measured)
        else:
            return
        load.start_new_period(now_s)

    def _idle(self, worker: registry.WorkerView, probe: dict) -> bool:
        local = self.directory.loads.get(worker.id)
        in_flight_here = local.in_flight if local else 0
        reported = probe.get("busy")
        return in_flight_here == 0 and (reported == 0 or (reported is None and probe["healthy"]))
