"""A revoked API key is refused at once, by every replica.

The replicas cache keys for a minute here (PARALON_KEY_CACHE_TTL_MS=60000),
so only the revocation reaching them can explain a refusal: on PostgreSQL a
NOTIFY in the revoking transaction, heard by each `serve` process; in the
process that revoked it, the eviction itself."""
from __future__ import annotations

import json
import time

import httpx
from click.testing import CliRunner
from sqlalchemy import text

from app.cli import main
from app.tokens import create_token
from ledger.money import usd_to_nano_usd
from proxy import keys
from proxy.revocations import LISTENER_APPLICATION_NAME
from tests.support.harness import MODEL, Fleet, make_fleet, serving, sim_worker, wait_for

KEY_CACHE_TTL_MS = "60000"
CREDITS_USD = "10"  # make_fleet's


def chat(proxy, key: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def assert_charged_exactly(fleet: Fleet, request_ids: list[str]) -> None:
    """Only these requests were charged, each split 80/20; nothing is held; the books verify."""
    settled = fleet.settlements()
    assert sorted(s["request_id"] for s in settled) == sorted(request_ids)
    customer = fleet.balance(fleet.customer_id)
    assert (customer.balance_nano_usd, customer.held_nano_usd) == (
        usd_to_nano_usd(CREDITS_USD) - sum(s["charge_nano_usd"] for s in settled), 0)
    assert fleet.balance(fleet.owner_ids[0]).balance_nano_usd == sum(s["charge_nano_usd"] * 80 // 100 for s in settled)
    fleet.assert_books_close()


def customer_token(fleet: Fleet) -> str:
    with fleet.engine.begin() as conn:
        return create_token(conn, fleet.customer_id, "customer")[1]


def test_a_key_revoked_on_one_replica_is_refused_by_the_other_at_once(postgres_url):
    worker = sim_worker("instant")
    fleet = make_fleet(postgres_url, [worker.url])
    token = customer_token(fleet)
    with serving(postgres_url, PARALON_KEY_CACHE_TTL_MS=KEY_CACHE_TTL_MS) as a, \
            serving(postgres_url, PARALON_KEY_CACHE_TTL_MS=KEY_CACHE_TTL_MS) as b:
        served = [chat(replica, fleet.key) for replica in (a, b)]  # both cache the key now
        assert [r.status_code for r in served] == [200, 200]
        revoked = httpx.delete(f"{a.url}/v1/keys/{fleet.key_id}", headers={"authorization": f"Bearer {token}"})
        assert revoked.status_code == 200
        refused = [chat(b, fleet.key), chat(a, fleet.key)]
    worker.stop()
    assert [r.status_code for r in refused] == [401, 401]
    assert refused[0].json()["error"]["code"] == "invalid_api_key"
    assert_charged_exactly(fleet, [r.json()["id"] for r in served])


def test_a_key_revoked_through_the_api_is_refused_by_the_same_process_at_once(database_url):
    """SQLite (the embedded default) has no notifications: the API evicts what it revokes."""
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url])
    token = customer_token(fleet)
    with serving(database_url, PARALON_KEY_CACHE_TTL_MS=KEY_CACHE_TTL_MS) as proxy:
        served = chat(proxy, fleet.key)
        assert served.status_code == 200
        assert httpx.delete(f"{proxy.url}/v1/keys/{fleet.key_id}", headers={"authorization": f"Bearer {token}"}).status_code == 200
        refused = chat(proxy, fleet.key)
    worker.stop()
    assert refused.status_code == 401
    assert_charged_exactly(fleet, [served.json()["id"]])


def _listener_pids(fleet: Fleet) -> list[int]:
    """Backends of revocation listeners that are listening (LISTEN ran on them)."""
    with fleet.engine.connect() as conn:
        return conn.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                 "AND application_name = :name AND query LIKE 'LISTEN %'"),
                            {"name": LISTENER_APPLICATION_NAME}).scalars().all()


def test_a_listener_that_lost_its_connection_listens_again_and_misses_no_revocation(postgres_url):
    """The listener's connection is killed and a key revoked at the same
    moment, from another process: the notification may be lost, so listening
    again forgets every cached key. A key revoked afterwards from the command
    line is refused at once too."""
    worker = sim_worker("instant")
    fleet = make_fleet(postgres_url, [worker.url])
    with fleet.engine.begin() as conn:
        second_id, second_key = keys.create_key(conn, fleet.customer_id)
    runner = CliRunner()
    with serving(postgres_url, PARALON_KEY_CACHE_TTL_MS=KEY_CACHE_TTL_MS) as proxy:
        served = [chat(proxy, fleet.key), chat(proxy, second_key)]
        assert [r.status_code for r in served] == [200, 200]
        [listener] = wait_for(lambda: _listener_pids(fleet))
        with fleet.engine.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": listener})
            keys.revoke_key(conn, fleet.key_id)
        wait_for(lambda: _listener_pids(fleet) not in ([], [listener]))
        time.sleep(0.2)  # from LISTEN done to the cache cleared is one step of the replica's event loop
        first_refused = chat(proxy, fleet.key)
        revoked = runner.invoke(main, ["keys", "revoke", str(second_id), "--json"], env={"PARALON_DATABASE_URL": postgres_url})
        assert revoked.exit_code == 0 and json.loads(revoked.stdout)["revoked"] is True
        second_refused = chat(proxy, second_key)
    worker.stop()
    assert (first_refused.status_code, second_refused.status_code) == (401, 401)
    assert_charged_exactly(fleet, [r.json()["id"] for r in served])
