"""/metrics is Prometheus text that prometheus_client's own parser reads, from
a registry per app; /health answers without a token."""
from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from app.http.status import LAG_METRIC, metrics_registry
from invoices import read_models
from ledger.schema import ledger_events


def _lag(site) -> float:
    response = site.call("GET", "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    [family] = [f for f in text_string_to_metric_families(response.text) if f.name == LAG_METRIC]
    [sample] = family.samples
    assert sample.labels == {"consumer": read_models.CONSUMER}
    return sample.value


def test_the_read_model_lag_is_measured_at_each_scrape(site):
    before = site.money()
    with site.engine.connect() as conn:
        events = conn.execute(select(func.max(ledger_events.c.seq))).scalar_one()
    assert _lag(site) == events > 0, "the consumer has applied nothing yet"
    read_models.catch_up(site.engine)
    assert _lag(site) == 0
    assert site.money() == before, "a scrape reads; catching up writes read models, never money"


def test_each_app_has_its_own_registry(site):
    labels = {"consumer": read_models.CONSUMER}
    assert REGISTRY.get_sample_value(LAG_METRIC, labels) is None, "nothing in prometheus_client's global registry"
    first, second = metrics_registry(site.engine), metrics_registry(site.engine)
    assert first.get_sample_value(LAG_METRIC, labels) == second.get_sample_value(LAG_METRIC, labels) > 0


def test_health_needs_no_token(site):
    assert site.call("GET", "/health").json() == {"status": "ok"}
