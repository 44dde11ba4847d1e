"""/metrics is Prometheus text that prometheus_client's own parser reads, from
a registry per app; /health answers without a token; /ready names what is
not ready (the database away is tested end to end in tests/app/test_database_faults.py)."""
from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from app.http.status import LAG_METRIC, ReadModelsBehind, _read_models_keep_up, metrics_registry
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


def test_ready_when_the_database_answers_and_the_read_models_keep_up(site):
    response = site.call("GET", "/ready")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ready" and set(body["checks"]) == {"database", "read_models"}, "no Redis configured"
    assert body["checks"]["database"]["ok"] and body["checks"]["read_models"]["lag_s"] >= 0


def test_ready_pings_the_configured_redis(site, redis_url):
    site.client.app.state.redis_url = redis_url
    assert site.call("GET", "/ready").json()["checks"]["redis"]["ok"] is True
    site.client.app.state.redis_url = "redis://127.0.0.1:1/0"  # nothing listens there
    response = site.call("GET", "/ready")
    assert response.status_code == 503 and response.headers["retry-after"]
    body = response.json()
    assert body["status"] == "not_ready" and body["checks"]["redis"]["ok"] is False
    assert body["checks"]["database"]["ok"] is True, "what failed is named; the rest still answered"


def test_read_models_too_far_behind_are_not_ready(site):
    before = site.money()
    with pytest.raises(ReadModelsBehind):
        _read_models_keep_up(site.engine, lag_s_max=0)  # anything not applied is too old
    read_models.catch_up(site.engine)
    assert _read_models_keep_up(site.engine, lag_s_max=0) == {"lag_s": 0.0}, "all applied: no lag at all"
    assert site.money() == before


def test_health_and_ready_are_documented(site):
    paths = site.call("GET", "/docs/openapi.json").json()["paths"]
    assert {"/health", "/ready"} <= set(paths)
    assert "503" in str(paths["/ready"]["get"]["description"])
