"""For operators: liveness, and Prometheus metrics (read-model lag) from a
registry of this app's own, so two apps in one process never share series."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine, select

from app.http.plumbing import json_response
from invoices import read_models
from ledger.schema import ledger_verifications

LAG_METRIC = "paralon_projection_lag_events"
LAG_HELP = "Events the read models have not applied yet."


class ReadModelLag(Collector):
    """Measured at each scrape (one query), never cached."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(LAG_METRIC, LAG_HELP, labels=["consumer"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(LAG_METRIC, LAG_HELP, labels=["consumer"])
        gauge.add_metric([read_models.CONSUMER], read_models.lag_events(self.engine))
        yield gauge


VERIFY_OK_METRIC = "paralon_ledger_verify_ok"
VERIFIED_SEQ_METRIC = "paralon_ledger_verified_seq"
VERIFY_PROBLEMS_METRIC = "paralon_ledger_verify_problems"


class LedgerVerification(Collector):
    """What the scheduled verification last found (app/jobs/ledger_check.py); nothing before its first run."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        v = ledger_verifications.c
        with self.engine.connect() as conn:
            row = conn.execute(select(v.ok, v.verified_seq, v.problems_total).where(v.id == 1, v.ok.is_not(None))).one_or_none()
        if row is None:
            return
        yield GaugeMetricFamily(VERIFY_OK_METRIC, "1 when the last scheduled ledger verification passed, else 0.", value=int(row.ok))
        yield GaugeMetricFamily(VERIFIED_SEQ_METRIC, "The last event whose hash chain is proven.", value=row.verified_seq)
        yield GaugeMetricFamily(VERIFY_PROBLEMS_METRIC, "Problems the last scheduled verification found.", value=row.problems_total)


def metrics_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReadModelLag(engine))
    registry.register(LedgerVerification(engine))
    return registry


@get("/metrics", summary="Prometheus metrics: read-model lag, the scheduled ledger verification")
async def metrics(request: Request) -> Response:
    text = await asyncio.to_thread(generate_latest, request.app.state.metrics)  # the collectors query the database
    return Response(text, media_type=CONTENT_TYPE_LATEST)


@get("/health", summary="Liveness")
async def health() -> Response:
    return json_response({"status": "ok"})
