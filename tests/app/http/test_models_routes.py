"""The models routes and CORS. `/v1/models` lists only models that can answer
now (a healthy worker that is neither draining, drained nor suspended), and
`/v1/models/{model}` (the SDK's models.retrieve) shows one of them or answers
404 in OpenAI's shape. CORS is off unless PARALON_CORS_ORIGINS names origins."""
from __future__ import annotations

import openai
import pytest

from proxy import prices
from proxy import workers as registry
from tests.app.http.conftest import _site
from tests.ledger.helpers import money_snapshot
from tests.proxy.test_workers_strikes import suspend_by_proof
from tests.support import harness
from tests.support.harness import MODEL, make_fleet, serving, sim_worker

SLASHED_MODEL = "org/live-model"  # names with a slash are common (Hugging Face ids)
HIDDEN = {"draining-model": "drain", "suspended-model": "suspend", "dead-model": "unreachable"}
ALLOWED_ORIGIN = "https://app.example"

# `paralon serve` took 35 s to listen on a machine loaded twentyfold: more than the harness waits.
SERVE_START_TIMEOUT_S = 120


@pytest.fixture
def fleet_of_states(database_url, monkeypatch):
    monkeypatch.setattr(harness, "START_TIMEOUT_S", SERVE_START_TIMEOUT_S)
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url])
    with fleet.engine.begin() as conn:
        for model in (SLASHED_MODEL, *HIDDEN):
            prices.set_price(conn, model, "0.15", "0.60")
        registry.add_worker(conn, fleet.owner_ids[0], worker.url, SLASHED_MODEL)
        draining = registry.add_worker(conn, fleet.owner_ids[0], worker.url, "draining-model")
        suspended = registry.add_worker(conn, fleet.owner_ids[0], worker.url, "suspended-model")
        registry.add_worker(conn, fleet.owner_ids[0], "http://127.0.0.1:1", "dead-model")
        registry.drain_worker(conn, draining)
    suspend_by_proof(fleet.engine, suspended, fleet.customer_id)
    with serving(database_url) as proxy:
        yield fleet, proxy
    worker.stop()
    fleet.engine.dispose()


def test_only_models_that_can_answer_are_listed_and_retrieved(fleet_of_states):
    fleet, proxy = fleet_of_states
    before = money_snapshot(fleet.engine)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)

    listed = client.models.list().data
    assert sorted(m.id for m in listed) == sorted([MODEL, SLASHED_MODEL])
    ours = next(m for m in listed if m.id == MODEL)
    assert ours.model_extra["pricing"]["input_usd_per_mtok"] == "0.150000000"
    assert ours.model_extra["pricing"]["output_nano_usd_per_token"] == 600

    one = client.models.retrieve(MODEL)
    assert (one.id, one.object, one.owned_by) == (MODEL, "model", "paralon")
    assert one.model_dump() == ours.model_dump(), "retrieved as listed"
    assert client.models.retrieve(SLASHED_MODEL).id == SLASHED_MODEL

    for model in ("no-such-model", *HIDDEN):
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve(model)
        assert missing.value.code == "model_not_found" and missing.value.type == "invalid_request_error"
        assert missing.value.param == "model" and model in missing.value.message
        assert missing.value.response.headers["x-should-retry"] == "false"
    assert money_snapshot(fleet.engine) == before


@pytest.fixture
def cors_site(tmp_path, monkeypatch):
    monkeypatch.setenv("PARALON_CORS_ORIGINS", f"{ALLOWED_ORIGIN}, http://localhost:5173")
    yield from _site(f"sqlite:///{tmp_path}/paralon.db", tmp_path)


def _preflight(site, origin: str):
    return site.client.options("/v1/chat/completions", headers={
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-os"})


def test_a_preflight_from_an_allowed_origin_is_answered_and_answers_expose_the_cost(cors_site):
    site = cors_site
    before = site.money()
    preflight = _preflight(site, ALLOWED_ORIGIN)
    assert preflight.status_code in (200, 204), preflight.text
    assert preflight.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()

    answer = site.client.post("/v1/chat/completions", headers={"origin": ALLOWED_ORIGIN, "authorization": f"Bearer {site.key}"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"})
    assert answer.status_code == 400 and answer.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    exposed = answer.headers["access-control-expose-headers"].lower()
    assert "x-request-id" in exposed and "x-paralon-cost-nano-usd" in exposed and "x-should-retry" in exposed
    assert site.money() == before


def test_a_disallowed_origin_gets_no_cors_grant(cors_site):
    site = cors_site
    refused = _preflight(site, "https://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    listed = site.client.get("/v1/models", headers={"origin": "https://evil.example", "authorization": f"Bearer {site.key}"})
    assert listed.status_code == 200 and "access-control-allow-origin" not in listed.headers


def test_cors_is_off_by_default(site):
    assert "access-control-allow-origin" not in _preflight(site, ALLOWED_ORIGIN).headers
    listed = site.client.get("/v1/models", headers={"origin": ALLOWED_ORIGIN, "authorization": f"Bearer {site.key}"})
    assert "access-control-allow-origin" not in listed.headers
