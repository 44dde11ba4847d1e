"""For operators: liveness, and Prometheus metrics (read-model lag) from a
registry of this app's own, so two apps in one process never share series."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from app.http.plumbing import json_response
from app.payments.stripe import parked_count
from invoices import read_models

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


class StripeParked(Collector):
    """Stripe events that failed and are not processed yet (`paralon stripe failed`)."""

    NAME, HELP = "paralon_stripe_parked_events", "Stripe webhook events parked after failing to process."

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, value=parked_count(self.engine))


def metrics_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReadModelLag(engine))
    registry.register(StripeParked(engine))
    return registry


@get("/metrics", summary="Prometheus metrics: read-model lag, parked Stripe events")
async def metrics(request: Request) -> Response:
    text = await asyncio.to_thread(generate_latest, request.app.state.metrics)  # the collectors query the database
    return Response(text, media_type=CONTENT_TYPE_LATEST)


@get("/health", summary="Liveness")
async def health() -> Response:
    return json_response({"status": "ok"})
