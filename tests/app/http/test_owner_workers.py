"""What a GPU owner sees of its workers through `paralon serve`, with two
simulated workers serving real requests: state (seconds left of a drain, why
suspended), measured capacity, share of the model's requests over 24 hours
and the prefix-cache hit rate the worker itself reports. An owner never sees
another owner's worker."""
from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import select

from app.cli import main
from app.tokens import create_token
from ledger.schema import accounts
from proxy import limits
from proxy import workers as registry
from tests.proxy.test_workers_strikes import suspend_by_proof
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for

UNREACHABLE_URL = "http://127.0.0.1:1"  # probes fail at once: never drained early, never routed to
# Long enough that a repeated prompt finds whole blocks in the simulated prefix cache.
PROMPTS = [f"Conversation {n}: " + "tell me about the weather over the hills and the sea. " * 8 for n in range(5)]
REPEATS = 2  # each prompt twice: the second time, its prefix is cached on the worker affinity chose


@pytest.fixture
def served(database_url):
    workers = [sim_worker("instant"), sim_worker("instant")]
    fleet = make_fleet(database_url, [w.url for w in workers])
    owner, other_owner = fleet.owner_ids
    with fleet.engine.begin() as conn:
        draining = registry.add_worker(conn, owner, UNREACHABLE_URL, MODEL)
        suspended = registry.add_worker(conn, owner, UNREACHABLE_URL, MODEL)
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == "platform:revenue")).scalar_one()
        tokens = {"owner": create_token(conn, owner, "owner")[1], "other_owner": create_token(conn, other_owner, "owner")[1],
                  "customer": create_token(conn, fleet.customer_id, "customer")[1],
                  "admin": create_token(conn, platform, "admin")[1]}
    suspend_by_proof(fleet.engine, suspended, fleet.customer_id)
    try:
        with serving(database_url, PARALON_CAPACITY_PERIOD_MS="1000") as proxy:
            yield fleet, workers, proxy, tokens, {"draining": draining, "suspended": suspended}
    finally:
        for worker in workers:
            worker.stop()
        fleet.engine.dispose()


def _get(proxy, path: str, token: str) -> httpx.Response:
    return httpx.get(proxy.url + path, headers={"authorization": f"Bearer {token}"}, timeout=30)


def _post(proxy, path: str, token: str) -> httpx.Response:
    return httpx.post(proxy.url + path, headers={"authorization": f"Bearer {token}"}, timeout=30)


def _ask(proxy, key: str, prompt: str) -> None:
    def answered() -> bool:  # the replica's first health check makes the workers routable
        response = httpx.post(proxy.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                              json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8})
        return response.status_code == 200

    wait_for(answered, timeout_s=30, interval_s=0.2)


def _seen(proxy, token: str) -> dict[int, dict]:
    response = _get(proxy, "/v1/workers", token)
    assert response.status_code == 200
    return {w["id"]: w for w in response.json()["data"]}


def test_an_owner_sees_state_capacity_traffic_share_and_prefix_cache_of_its_own_workers_only(served):
    fleet, sims, proxy, tokens, extra = served
    mine, theirs = fleet.worker_ids
    for prompt in PROMPTS * REPEATS:
        _ask(proxy, fleet.key, prompt)
    served_by = Counter(s["meta"]["worker_id"] for s in fleet.settlements())
    total = sum(served_by.values())
    assert total == len(PROMPTS) * REPEATS
    counters = {worker_id: sim.app.engine.state for worker_id, sim in zip(fleet.worker_ids, sims)}
    assert sum(c.prefix_cache_hits_tokens for c in counters.values()) > 0, "the repeated prompts found their prefixes"

    def settled_and_scraped() -> dict[int, dict] | None:
        """Once the read models hold every request, the heartbeats carry the workers' final counters
        and both workers' capacities were measured. Each heartbeat may measure the capacity anew,
        so the listing is compared with the worker's row read just after it, until one pair agrees."""
        seen = {**_seen(proxy, tokens["owner"]), **_seen(proxy, tokens["other_owner"])}
        done = sum(seen[w]["requests_24h"] for w in fleet.worker_ids) == total and all(
            seen[w]["prefix_cache_queries_tokens"] == counters[w].prefix_cache_queries_tokens
            and seen[w]["throughput_tokens_per_s"] == fleet.worker(w).throughput_tokens_per_s is not None
            for w in fleet.worker_ids)
        return seen if done else None

    seen = wait_for(settled_and_scraped, timeout_s=30, interval_s=0.2)
    for worker_id in fleet.worker_ids:
        shown, state = seen[worker_id], counters[worker_id]
        assert shown["state"] == "active" and shown["drain_seconds_left"] is None
        assert shown["requests_24h"] == served_by[worker_id]
        assert shown["traffic_share_24h"] == round(served_by[worker_id] / total, 4)
        assert shown["prefix_cache_hits_tokens"] == state.prefix_cache_hits_tokens
        expected_rate = round(state.prefix_cache_hits_tokens / state.prefix_cache_queries_tokens, 4) \
            if state.prefix_cache_queries_tokens else None
        assert shown["prefix_cache_hit_rate"] == expected_rate
        assert shown["throughput_tokens_per_s"] >= 1

    drained = _post(proxy, f"/v1/workers/{extra['draining']}/drain", tokens["owner"]).json()
    # counted from when the drain was asked: the call itself (a row lock behind a heartbeat) may take a second
    assert drained["state"] == "draining" and limits.DRAIN_DEADLINE_S - 2 <= drained["drain_seconds_left"] <= limits.DRAIN_DEADLINE_S
    own = _seen(proxy, tokens["owner"])
    assert set(own) == {mine, extra["draining"], extra["suspended"]}, "the other owner's worker is not listed"
    assert own[extra["draining"]]["state"] == "draining" and 0 < own[extra["draining"]]["drain_seconds_left"] <= 120
    suspended = own[extra["suspended"]]
    assert (suspended["state"], suspended["suspension_reason"]) == ("suspended", "3 usage strikes: completion_above_bound")
    for idle in (own[extra["draining"]], suspended):  # never answered a probe, never served
        assert (idle["throughput_tokens_per_s"], idle["prefix_cache_hit_rate"], idle["requests_24h"]) == (None, None, 0)
        assert idle["traffic_share_24h"] == 0.0, "its model had requests; none of them went to it"

    assert _post(proxy, f"/v1/workers/{theirs}/drain", tokens["owner"]).status_code == 404
    assert fleet.worker(theirs).state == "active", "nothing written"
    assert set(_seen(proxy, tokens["other_owner"])) == {theirs}
    assert set(_seen(proxy, tokens["admin"])) == {mine, theirs, extra["draining"], extra["suspended"]}
    assert _get(proxy, "/v1/workers", tokens["customer"]).status_code == 403

    listed = CliRunner().invoke(main, ["workers", "list", "--json"], env={"PARALON_DATABASE_URL": fleet.database_url},
                                catch_exceptions=False)
    by_id = {w["id"]: w for w in json.loads(listed.output)["workers"]}
    for worker_id in fleet.worker_ids:
        assert {k: by_id[worker_id][k] for k in ("requests_24h", "traffic_share_24h", "prefix_cache_hit_rate")} == \
            {k: seen[worker_id][k] for k in ("requests_24h", "traffic_share_24h", "prefix_cache_hit_rate")}
