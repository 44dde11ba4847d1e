"""The proxy with pooled holds (PARALON_HOLD_POOLS=1): each replica reserves
its requests from one hold per customer and spend limit, captures each
request's charge from it (not finally), moves a stream that delivers for
longer than a renewal to a hold of its own, and releases a pool nobody used
for a while. Charged exactly as with a hold per request, never overspent,
and a replica killed mid-stream is settled at what its callers received."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
from sqlalchemy import func, select

from ledger.schema import holds
from proxy.limits import HOLD_POOL_IDLE_S
from tests.support.harness import MODEL, lowest_available_watched, make_fleet, serving, sim_worker, wait_for, watched

POOLED = {"PARALON_HOLD_POOLS": "1"}
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def _hold_rows(fleet) -> int:
    with fleet.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(holds)).scalar_one()


def _recorded_capture(fleet) -> int:
    with fleet.engine.connect() as conn:
        return conn.execute(select(func.coalesce(func.max(holds.c.capture_nano_usd), 0))).scalar_one()


async def _streams(url: str, key: str, count: int, max_tokens: int, *, plain: int = 0) -> list:
    """`count` requests at once, all streamed but the first `plain`: (request
    id, usage) each, or (None, status) when refused."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)

    async def one(i: int):
        messages = [{"role": "user", "content": f"story {i:03d}"}]
        try:
            if i < plain:
                answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
                return answer.id, answer.usage
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            return chunks[-1].id, chunks[-1].usage
        except openai.APIStatusError as exc:
            return None, exc.status_code

    try:
        return await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        await client.close()


def _holds_watched(fleet):
    """The hold rows (id, idempotency key) and the customer's held sum, watched
    while the block runs: what was reserved while requests ran, whatever the
    machine's speed."""
    def read() -> tuple[list, int]:
        with fleet.engine.connect() as conn:
            rows = conn.execute(select(holds.c.id, holds.c.idempotency_key)).all()
        return rows, fleet.balance(fleet.customer_id).held_nano_usd

    return watched(read, interval_s=0.01)


def _seen(readings: list) -> dict[int, str]:
    """Every hold row watched: id -> idempotency key (SQLite may give a later hold a released one's id)."""
    return {hold_id: key for rows, _ in readings for hold_id, key in rows}


def test_pooled_requests_are_charged_exactly_and_the_idle_pool_is_released(database_url):
    """Twenty plain requests and twenty streams at once. A plain request never
    moves, so all twenty capture from the one pool, not finally; a stream
    still delivering at a renewal (a slow machine) moves to a hold of its own
    and is captured finally there. Watched until the idle pool is released."""
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url])
    with serving(database_url, **POOLED) as proxy, _holds_watched(fleet) as readings:
        results = asyncio.run(_streams(proxy.url, fleet.key, 40, 20, plain=20))
        wait_for(lambda: _hold_rows(fleet) == 0, timeout_s=HOLD_POOL_IDLE_S + 10)
    worker.stop()
    pools = {hold_id for hold_id, key in _seen(readings).items() if key.startswith("pool:")}
    assert len(pools) == 1 and max(held for _, held in readings) > 0, "forty requests, one pooled hold, reserved while they ran"
    settled = {s["request_id"]: s for s in fleet.settlements()}
    assert set(settled) == {rid for rid, _ in results} and len(settled) == 40
    plain = {rid for rid, _ in results[:20]}
    assert {settled[rid]["hold_id"] for rid in plain} == pools, "every plain request from the pool"
    from_pool = [s for s in settled.values() if s["hold_id"] in pools]
    assert all(s["released_nano_usd"] == 0 for s in from_pool), "captures that are not final"
    for rid, usage in results:
        assert settled[rid]["charge_nano_usd"] == usage.model_extra["cost_details"]["nano_usd"]
    customer = fleet.balance(fleet.customer_id)
    assert (customer.held_nano_usd, customer.balance_nano_usd) == (0, 10 * 10**9 - sum(s["charge_nano_usd"] for s in settled.values()))
    fleet.assert_books_close()


def test_200_pooled_streams_against_credits_for_about_100_never_overspend(database_url):
    """Credit for one whole pool and some more: the pool, then holds of their
    own for what it leaves (no second pool fits), then refusals."""
    worker = sim_worker("h200", time_scale=4.0)
    fleet = make_fleet(database_url, [worker.url], credits_usd="0.00300")
    with serving(database_url, **POOLED) as proxy, _holds_watched(fleet) as readings:
        with lowest_available_watched(fleet) as lowest:
            results = asyncio.run(_streams(proxy.url, fleet.key, 200, 40))
        wait_for(lambda: _hold_rows(fleet) == 0, timeout_s=HOLD_POOL_IDLE_S + 10)
    worker.stop()
    completed = {rid: usage for rid, usage in results if rid is not None}
    refused = [status for rid, status in results if rid is None]
    assert set(refused) <= {402} and 10 <= len(completed) < 200
    assert min(lowest) >= 0
    seen = _seen(readings)
    pools = [k for k in seen.values() if k.startswith("pool:")]
    assert len(pools) == 1 and len(seen) > 1, ("one pool, holds of their own beside it", len(seen))
    settled = {s["request_id"]: s for s in fleet.settlements()}
    assert set(settled) == {rid for rid, usage in completed.items() if usage.completion_tokens}
    customer = fleet.balance(fleet.customer_id)
    assert customer.held_nano_usd == 0 and customer.balance_nano_usd == 3_000_000 - sum(s["charge_nano_usd"] for s in settled.values())
    fleet.assert_books_close()


def test_a_key_limit_is_never_overshot_by_concurrent_pooled_requests(database_url):
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url], spend_limit_usd="0.0002")
    with serving(database_url, **POOLED) as proxy:
        results = asyncio.run(_streams(proxy.url, fleet.key, 60, 20))
    worker.stop()
    charged = sum(s["charge_nano_usd"] for s in fleet.settlements())
    assert any(rid is None for rid, _ in results), "the limit refused some"
    assert 0 < charged <= 200_000, "never more than the key's limit"
    fleet.assert_books_close()


def test_a_stream_that_outlives_a_renewal_moves_to_its_own_hold_and_a_kill_settles_it_at_what_was_received(database_url):
    """kill -9 three seconds into a stream: by then it recorded its delivery on
    a hold of its own; the replica restarted under the same id settles that
    hold at what the caller had received and releases the pool."""
    worker = sim_worker("h200", time_scale=0.25)  # about 40 tokens a second
    fleet = make_fleet(database_url, [worker.url])
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    env = {**POOLED, "PARALON_REPLICA_ID": "pooled-replica"}
    received, recorded_before_kill = 0, 0
    with serving(database_url, **env) as doomed:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True}
        headers = {"authorization": f"Bearer {fleet.key}"}
        with httpx.stream("POST", doomed.url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as response:
            started = time.monotonic()
            try:
                for line in response.iter_lines():
                    received += line.startswith("data: {")
                    if time.monotonic() - started > 3 and doomed.process.poll() is None:
                        recorded_before_kill = _recorded_capture(fleet)
                        doomed.process.kill()  # no finally, no settlement, no release
            except httpx.HTTPError:
                pass
        doomed.process.wait(10)
    assert recorded_before_kill > 0, "the stream recorded what it delivered, on a hold of its own"
    with serving(database_url, **env):
        wait_for(lambda: _hold_rows(fleet) == 0, timeout_s=30)
    worker.stop()
    [settled] = fleet.settlements()
    billed = settled["meta"]["completion_tokens"]
    assert received - 2 * 45 <= billed <= received, (billed, received)
    assert settled["released_nano_usd"] > 0, "its own hold, settled finally"
    assert fleet.balance(fleet.customer_id).balance_nano_usd == before - settled["charge_nano_usd"]
    assert fleet.balance(fleet.customer_id).held_nano_usd == 0
    fleet.assert_books_close()
