"""The proxy end to end: the official `openai` SDK against `paralon serve`,
in front of simulated vLLM workers, on SQLite and on PostgreSQL."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from app.http.status import LAG_METRIC
from invoices.schema import usage_daily
from proxy.generations import generation_record
from proxy.keys import revoke_key
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def one_worker(database_url):
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url])
    with serving(database_url) as proxy:
        yield fleet, proxy
    worker.stop()
    fleet.engine.dispose()


def _client(fleet, proxy, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key or fleet.key, max_retries=0)


def test_the_openai_sdk_gets_billed_answers_sync_and_streaming(one_worker):
    fleet, proxy = one_worker
    client = _client(fleet, proxy)
    before = fleet.balance(fleet.customer_id).balance_nano_usd

    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    answer = raw.parse()
    assert answer.choices[0].message.content.strip()
    assert answer.model == MODEL and answer.usage.completion_tokens == 5
    cost_nano_usd = int(raw.headers["x-paralon-cost-nano-usd"])
    assert cost_nano_usd == answer.usage.prompt_tokens * 150 + 5 * 600
    assert answer.usage.model_extra["cost_details"] == {"nano_usd": cost_nano_usd}
    assert f'"cost":0.{cost_nano_usd:09d},'.encode() in raw.http_response.content  # a JSON number, nine decimals
    assert raw.headers["x-request-id"] == answer.id

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(text_chunks) == 4
    assert all(c.usage is None for c in chunks[:-1]), "usage only in the last chunk, as asked"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4

    plain = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True))
    assert all(c.usage is None for c in plain), "no usage chunk the caller did not ask for"

    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert completion.usage.completion_tokens == 6 and completion.choices[0].text

    generation = httpx.get(f"{proxy.url}/v1/generations/{answer.id}", headers={"authorization": f"Bearer {fleet.key}"}).json()
    assert generation["cost_nano_usd"] == cost_nano_usd
    assert generation["completion_tokens"] == 5
    assert "worker_id" not in generation and "owner_nano_usd" not in generation, "the owner's side is not the customer's"
    with fleet.engine.connect() as conn:
        assert generation_record(conn, answer.id)["worker_id"] == fleet.worker_ids[0]

    settled = fleet.settlements()
    assert len(settled) == 4
    assert fleet.balance(fleet.customer_id).balance_nano_usd == before - sum(s["charge_nano_usd"] for s in settled)
    fleet.pools_released()
    assert fleet.balance(fleet.customer_id).held_nano_usd == 0
    fleet.assert_books_close()


def test_the_async_sdk_streams_concurrently(one_worker):
    fleet, proxy = one_worker

    async def main():
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        async def one(i):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=8, stream=True,
                stream_options={"include_usage": True})
            return [c async for c in stream][-1].usage
        usages = await asyncio.gather(*(one(i) for i in range(20)))
        single = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        await client.close()
        return usages, single

    usages, single = asyncio.run(main())
    assert all(u.completion_tokens == 8 for u in usages)
    assert single.usage.completion_tokens == 2
    assert len(fleet.settlements()) == 21
    fleet.assert_books_close()


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value


def test_errors_use_openai_shapes_and_move_no_money(one_worker):
    fleet, proxy = one_worker
    client = _client(fleet, proxy)
    before = fleet.balance(fleet.customer_id)

    bad_key = _error(lambda: _client(fleet, proxy, key="sk-par-nope").chat.completions.create(model=MODEL, messages=MESSAGES))
    assert bad_key.status_code == 401 and bad_key.body["type"] == "authentication_error"
    unknown = _error(lambda: client.chat.completions.create(model="no-such-model", messages=MESSAGES))
    assert unknown.status_code == 404 and unknown.body["code"] == "model_not_found"
    invalid = _error(lambda: client.chat.completions.create(model=MODEL, messages=[]))
    assert invalid.status_code == 400 and invalid.body["type"] == "invalid_request_error"
    too_long = _error(lambda: client.chat.completions.create(  # 40,004 tokens as the worker counts them, above its 32,768
        model=MODEL, messages=[{"role": "user", "content": "x" * 160_000}], max_tokens=10))
    assert too_long.status_code == 400 and too_long.body["code"] == "context_length_exceeded"
    not_json = httpx.post(proxy.url + "/v1/chat/completions", content=b"{not json",
                          headers={"authorization": f"Bearer {fleet.key}", "content-type": "application/json"})
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"

    after = fleet.balance(fleet.customer_id)
    assert (after.balance_nano_usd, after.held_nano_usd) == (before.balance_nano_usd, 0)
    assert fleet.settlements() == []


def test_a_revoked_key_is_refused(one_worker):
    fleet, proxy = one_worker
    with fleet.engine.begin() as conn:
        revoke_key(conn, fleet.key_id)
    error = _error(lambda: _client(fleet, proxy).chat.completions.create(model=MODEL, messages=MESSAGES))
    assert error.status_code == 401
    assert fleet.settlements() == []


def test_an_empty_completion_costs_nothing(database_url):
    worker = sim_worker("instant", stop_after_tokens=0)
    fleet = make_fleet(database_url, [worker.url])
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    with serving(database_url) as proxy:
        answer = _client(fleet, proxy).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    worker.stop()
    assert answer.choices[0].message.content == "" and answer.usage.model_extra["cost_details"] == {"nano_usd": 0}
    assert fleet.settlements() == []
    after = fleet.balance(fleet.customer_id)
    assert (after.balance_nano_usd, after.held_nano_usd) == (before, 0)


def test_models_list_prices_and_context(one_worker):
    fleet, proxy = one_worker
    models = _client(fleet, proxy).models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["pricing"]["output_nano_usd_per_token"] == 600
    assert models[0].model_extra["context_length"] > 0


def test_the_api_docs_are_served_without_the_internet(one_worker):
    _, proxy = one_worker
    page = httpx.get(proxy.url + "/docs")
    assert page.status_code == 200 and "https://" not in page.text
    assert httpx.get(proxy.url + "/docs/assets/swagger-ui-bundle.js").status_code == 200
    assert "/v1/chat/completions" in httpx.get(proxy.url + "/docs/openapi.json").json()["paths"]


def test_the_read_model_lag_is_exported_as_a_metric(one_worker):
    """The replica's own follower applies the grant and the settlement, and the
    metric counts down to zero as it does."""
    fleet, proxy = one_worker
    _client(fleet, proxy).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    seen = []

    def lag_events() -> float:
        families = text_string_to_metric_families(httpx.get(proxy.url + "/metrics").text)
        seen.append(next(f for f in families if f.name == LAG_METRIC).samples[0].value)
        return seen[-1]

    wait_for(lambda: lag_events() == 0)
    assert all(lag >= 0 for lag in seen)
    with fleet.engine.connect() as conn:
        usage = conn.execute(sa.select(usage_daily.c.requests).where(usage_daily.c.account_id == fleet.customer_id)).all()
    assert usage == [(1,)], "the settlement reached the usage read model"


def test_no_healthy_worker_is_503_and_moves_no_money(database_url):
    """Given a model whose only worker does not answer its health check, a
    request gets OpenAI's error JSON with 503 and nothing is held or charged."""
    fleet = make_fleet(database_url, ["http://127.0.0.1:9"])  # nothing listens on port 9
    with serving(database_url) as proxy:
        error = _error(lambda: _client(fleet, proxy).chat.completions.create(model=MODEL, messages=MESSAGES))
    assert error.status_code == 503 and error.body["code"] == "no_worker_available"
    customer = fleet.balance(fleet.customer_id)
    assert customer.held_nano_usd == 0 and fleet.settlements() == []
    fleet.engine.dispose()
