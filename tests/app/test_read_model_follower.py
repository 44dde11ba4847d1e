"""The read models follow the log under `paralon serve` alone (issue 13, item
10): usage and earnings fill without anyone asking for a statement, within
READ_MODELS_LAG_S_MAX, also under a 1,000-request load; on PostgreSQL one
replica applies (the advisory lock), the other skips, a replica that dies
hands the lock over with its connection, and every settlement counts exactly
once. The follower stops cleanly with the process."""
from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from app.jobs.read_model_follower import FollowerState, ReadModelFollower
from app.limits import READ_MODELS_LAG_S_MAX
from app.tokens import create_token
from invoices import read_models
from invoices.schema import account_postings, earnings_daily, usage_daily
from ledger.schema import ledger_postings
from tests.support.harness import MODEL, ServeProcess, SimWorkerProcess, make_fleet, serving, sim_worker, wait_for

LOAD_REQUESTS = 1_000
LOAD_CALLERS = 16
LAG_SAMPLE_INTERVAL_S = 0.1
# A generous wait for what the bound promises (the machine may be shared): the
# assertion is on the lag the read models report, not on how fast this machine is.
CAUGHT_UP_WAIT_S = 120
STOP_WAIT_S = 30
MAX_TOKENS = 4


@pytest.fixture
def worker():
    server = sim_worker("instant")
    yield server
    server.stop()


@pytest.fixture
def worker_process():
    """In a process of its own: the load test's 16 callers here must not starve its health checks."""
    server = SimWorkerProcess("instant").start()
    yield server
    server.stop()


def _ask(url: str, key: str, client: httpx.Client | None = None) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": MAX_TOKENS}
    response = (client or httpx).post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                                      timeout=STOP_WAIT_S)
    assert response.status_code == 200, response.text


def _settled_totals(fleet) -> dict:
    settled = fleet.settlements()
    return {"requests": len(settled), "cost_nano_usd": sum(s["charge_nano_usd"] for s in settled),
            "completion_tokens": sum(s["meta"]["completion_tokens"] for s in settled),
            "earnings_nano_usd": sum(s["owner_nano_usd"] for s in settled)}


def _read_model_totals(engine) -> dict:
    with engine.connect() as conn:
        usage = conn.execute(select(func.coalesce(func.sum(usage_daily.c.requests), 0),
                                    func.coalesce(func.sum(usage_daily.c.cost_nano_usd), 0),
                                    func.coalesce(func.sum(usage_daily.c.completion_tokens), 0))).one()
        earned = conn.execute(select(func.coalesce(func.sum(earnings_daily.c.earnings_nano_usd), 0))).scalar_one()
    return {"requests": int(usage[0]), "cost_nano_usd": int(usage[1]), "completion_tokens": int(usage[2]),
            "earnings_nano_usd": int(earned)}


def _postings_copied_once(engine) -> bool:
    with engine.connect() as conn:
        return (conn.execute(select(func.count()).select_from(account_postings)).scalar_one()
                == conn.execute(select(func.count()).select_from(ledger_postings)).scalar_one())


def _caught_up(fleet) -> bool:
    return read_models.lag_events(fleet.engine) == 0 and _read_model_totals(fleet.engine) == _settled_totals(fleet)


def _is_applier(replica: ServeProcess) -> int:
    families = text_string_to_metric_families(httpx.get(replica.url + "/metrics", timeout=STOP_WAIT_S).text)
    return int(next(f for f in families if f.name == FollowerState.NAME).samples[0].value)


def _stops_cleanly(replica: ServeProcess) -> bool:
    """SIGTERM, as an orchestrator stops a replica: the drain, then the follower, then uvicorn
    ends the process with the signal it caught. Nothing failed or was left hanging on the way."""
    replica.process.terminate()
    status = replica.process.wait(STOP_WAIT_S)
    said = replica.process.stdout.read()
    assert "Traceback" not in said and "did not stop" not in said, said
    return status in (0, -signal.SIGTERM)


def test_serve_alone_fills_usage_and_earnings_without_being_asked(database_url, worker):
    fleet = make_fleet(database_url, [worker.url])
    with fleet.engine.begin() as conn:
        customer_token = create_token(conn, fleet.customer_id, "customer")[1]
        owner_token = create_token(conn, fleet.owner_ids[0], "owner")[1]
    money_before = fleet.balance(fleet.customer_id).balance_nano_usd
    with serving(database_url) as proxy:
        for _ in range(5):
            _ask(proxy.url, fleet.key)
        settled = _settled_totals(fleet)
        # Nothing but the follower applies: no statement, no catch-up command, no beat.
        wait_for(lambda: _caught_up(fleet), timeout_s=CAUGHT_UP_WAIT_S)
        usage = httpx.get(proxy.url + "/v1/usage?group_by=model", headers={"authorization": f"Bearer {customer_token}"}).json()
        earnings = httpx.get(proxy.url + "/v1/earnings?group_by=model", headers={"authorization": f"Bearer {owner_token}"}).json()
        assert usage["data"] == [{"model": MODEL, "requests": 5, "prompt_tokens": usage["data"][0]["prompt_tokens"],
                                  "completion_tokens": 5 * MAX_TOKENS, "cost_nano_usd": settled["cost_nano_usd"]}]
        assert earnings["data"] == [{"model": MODEL, "requests": 5, "earnings_nano_usd": settled["earnings_nano_usd"]}]
        assert _is_applier(proxy) == 1
        assert _stops_cleanly(proxy), "the follower stopped with the process"
    assert money_before - fleet.balance(fleet.customer_id).balance_nano_usd == settled["cost_nano_usd"]
    assert _postings_copied_once(fleet.engine)
    fleet.assert_books_close()


def test_under_a_thousand_requests_the_lag_stays_within_the_bound(postgres_url, worker_process):
    fleet = make_fleet(postgres_url, [worker_process.url], credits_usd="100")
    money_before = fleet.balance(fleet.customer_id).balance_nano_usd
    samples_s: list[float] = []
    load_done = threading.Event()

    def sample() -> None:  # as an operator's scrape of paralon_projection_lag_seconds would
        while not load_done.wait(LAG_SAMPLE_INTERVAL_S):
            samples_s.append(read_models.lag_seconds(fleet.engine))

    with serving(postgres_url) as proxy:
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with httpx.Client() as client, ThreadPoolExecutor(LOAD_CALLERS) as callers:
                list(callers.map(lambda _: _ask(proxy.url, fleet.key, client), range(LOAD_REQUESTS)))
        finally:
            load_done.set()
            sampler.join()
        assert fleet.events("RequestSettled") == LOAD_REQUESTS
        assert len(samples_s) > 1 and max(samples_s) <= READ_MODELS_LAG_S_MAX, f"lag during the load: max {max(samples_s):.2f} s"
        wait_for(lambda: _caught_up(fleet), timeout_s=CAUGHT_UP_WAIT_S)
        assert read_models.lag_seconds(fleet.engine) == 0.0
    assert _read_model_totals(fleet.engine)["requests"] == LOAD_REQUESTS
    assert money_before - fleet.balance(fleet.customer_id).balance_nano_usd == _settled_totals(fleet)["cost_nano_usd"]
    assert _postings_copied_once(fleet.engine)
    fleet.assert_books_close()


def test_two_replicas_one_applies_and_a_dead_one_hands_the_lock_over(postgres_url, worker):
    fleet = make_fleet(postgres_url, [worker.url])
    money_before = fleet.balance(fleet.customer_id).balance_nano_usd
    first = ServeProcess(postgres_url).start()
    second = ServeProcess(postgres_url)
    try:
        wait_for(lambda: _is_applier(first) == 1, timeout_s=CAUGHT_UP_WAIT_S)
        second.start()
        for i in range(20):
            _ask((first, second)[i % 2].url, fleet.key)
        wait_for(lambda: _caught_up(fleet), timeout_s=CAUGHT_UP_WAIT_S)
        assert (_is_applier(first), _is_applier(second)) == (1, 0), "the lock is held by one; the other skips"
        assert read_models.catch_up_alone(fleet.engine) is None, "beat's task skips too while a replica applies"

        os.killpg(first.process.pid, signal.SIGKILL)  # dies holding the lock: its connection, and the lock, go with it
        first.process.wait()
        wait_for(lambda: _is_applier(second) == 1, timeout_s=CAUGHT_UP_WAIT_S)
        for _ in range(10):
            _ask(second.url, fleet.key)
        wait_for(lambda: _caught_up(fleet), timeout_s=CAUGHT_UP_WAIT_S)
        assert _read_model_totals(fleet.engine)["requests"] == 30, "each settlement exactly once"
        assert _stops_cleanly(second)
    finally:
        first.stop()
        second.stop()
    assert read_models.catch_up_alone(fleet.engine) == 0, "the lock went with the replica that stopped"
    assert money_before - fleet.balance(fleet.customer_id).balance_nano_usd == _settled_totals(fleet)["cost_nano_usd"]
    assert _postings_copied_once(fleet.engine)
    fleet.assert_books_close()


def test_the_follower_holds_the_lease_until_it_stops(database_url, worker):
    fleet = make_fleet(database_url, [worker.url])
    follower = ReadModelFollower(fleet.engine).start()
    try:
        wait_for(lambda: follower.is_applier and read_models.lag_events(fleet.engine) == 0, timeout_s=CAUGHT_UP_WAIT_S)
        assert read_models.catch_up_alone(fleet.engine) is None, "a second applier skips"
        other = ReadModelFollower(fleet.engine)
        assert other.follow_once() == 0 and not other.is_applier
    finally:
        assert follower.stop(), "the thread ended"
    assert not follower.is_applier
    assert read_models.catch_up_alone(fleet.engine) == 0, "the lease was released with it"
