"""The OpenAI routes at the HTTP edge (the relay itself is tested in
tests/proxy): models with prices, a request's recorded charge, and requests
refused before anything is held."""
from __future__ import annotations

from tests.app.http.conftest import MODEL


def test_a_model_whose_workers_are_all_unreachable_is_not_listed(site):
    """The site's workers never answer a probe: listed models are those that can answer
    (tests/app/http/test_models_routes.py shows a listed one, with its prices)."""
    assert site.call("GET", "/v1/models", site.key).json()["data"] == []
    missing = site.call("GET", f"/v1/models/{MODEL}", site.key)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_request_is_refused_before_anything_is_held(site):
    before = site.money()
    not_json = site.call("POST", "/v1/chat/completions", site.key, content=b"{nope")
    assert not_json.status_code == 400 and not_json.json()["error"]["message"] == "the request body is not valid JSON"
    not_an_object = site.call("POST", "/v1/chat/completions", site.key, json=[1, 2])
    assert not_an_object.status_code == 400
    no_worker = site.call("POST", "/v1/chat/completions", site.key,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert no_worker.status_code == 503 and no_worker.json()["error"]["code"] == "no_worker_available"
    assert site.money() == before, "nothing charged, no hold left behind"


def test_a_generation_is_read_back_by_its_own_account_only(site):
    before = site.money()
    found = site.call("GET", f"/v1/generations/{site.settled_request_id}", site.key)
    assert found.status_code == 200 and found.json()["cost_nano_usd"] == 3_000
    assert site.call("GET", f"/v1/generations/{site.settled_request_id}", site.other_key).status_code == 404
    assert site.call("GET", "/v1/generations/no-such-request", site.key).json()["error"]["code"] == "generation_not_found"
    assert site.money() == before


def test_a_flag_that_is_not_a_json_boolean_is_refused_before_anything_is_held(site):
    """"stream": "false" is a string, and a string is true: it would stream to a
    caller that asked not to. Flags are JSON booleans (null meaning false)."""
    before = site.money()
    messages = [{"role": "user", "content": "hi"}]
    for body, param in (({"stream": "false"}, "stream"), ({"stream": 0}, "stream"),
                        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage")):
        response = site.call("POST", "/v1/chat/completions", site.key, json={"model": MODEL, "messages": messages, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert site.money() == before, "nothing charged, no hold left behind"
