"""The fleet: draining under load, heartbeats, affinity across proxy replicas."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai

from ledger import accounts as acc
from proxy import workers as registry
from proxy.generations import generation_record
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for


def _worker_of(proxy, fleet, request_id: str) -> int:
    """Which worker served a request: the settlement says (the customer's /v1/generations does not)."""
    found = httpx.get(f"{proxy.url}/v1/generations/{request_id}", headers={"authorization": f"Bearer {fleet.key}"})
    assert found.status_code == 200, found.text
    with fleet.engine.connect() as conn:
        return generation_record(conn, request_id)["worker_id"]


def test_draining_under_load_drops_no_request_and_ends_drained(database_url):
    """Given two paced workers under load, when one is drained, then every
    in-flight request completes, new requests avoid it, and it ends `drained`."""
    first, second = sim_worker("h200", time_scale=2.0), sim_worker("h200", time_scale=2.0)
    fleet = make_fleet(database_url, [first.url, second.url])
    drained_id = fleet.worker_ids[0]
    with serving(database_url) as proxy:
        fleet.await_routable()  # else every early request may go to the one worker found healthy first

        async def load():
            client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0, timeout=60)

            async def one(i, delay_s):
                await asyncio.sleep(delay_s)
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"conversation {i}"}], max_tokens=120,
                    stream=True, stream_options={"include_usage": True})
                chunks = [c async for c in stream]
                return chunks[-1].id, chunks[-1].usage.completion_tokens

            async def drain_soon():
                # Drained once it is serving, not after a fixed delay a loaded machine could outrun.
                deadline = time.monotonic() + 30
                while first.app.state.requests_running == 0:
                    assert time.monotonic() < deadline, "the first worker never served"
                    await asyncio.sleep(0.01)
                with fleet.engine.begin() as conn:
                    registry.drain_worker(conn, drained_id)
                return time.monotonic()

            tasks = [one(i, 0.0) for i in range(24)]
            drain_task = asyncio.create_task(drain_soon())
            early = await asyncio.gather(*tasks)
            drained_at = await drain_task
            await asyncio.sleep(1.5)  # every replica has seen the drain
            late = await asyncio.gather(*(one(100 + i, 0.0) for i in range(12)))
            await client.close()
            return early, late, drained_at

        early, late, _ = asyncio.run(load())
        assert all(tokens == 120 for _, tokens in early + late), "no request dropped or cut short"
        early_workers = {_worker_of(proxy, fleet, rid) for rid, _ in early}
        assert drained_id in early_workers, "the drained worker had requests in flight"
        assert all(_worker_of(proxy, fleet, rid) != drained_id for rid, _ in late)
        wait_for(lambda: fleet.worker(drained_id).state == "drained", timeout_s=10)
        with fleet.engine.begin() as conn:  # a heartbeat arriving now must not bring it back
            registry.record_heartbeat(conn, drained_id, healthy=True)
        time.sleep(0.5)  # the proxy's own health checks keep recording heartbeats meanwhile
        assert fleet.worker(drained_id).state == "drained"
    first.stop(), second.stop()


def test_a_heartbeat_never_undoes_a_drain(engine):
    with engine.begin() as conn:
        owner = acc.create_account(conn, "owner", "o")
        worker_id = registry.add_worker(conn, owner, "http://127.0.0.1:1", MODEL)
        registry.drain_worker(conn, worker_id)
        registry.record_heartbeat(conn, worker_id, healthy=True, context_length=4096)
        assert registry.get_worker(conn, worker_id).state == "draining"
        assert registry.mark_drained(conn, worker_id)
        registry.record_heartbeat(conn, worker_id, healthy=True)
        assert registry.get_worker(conn, worker_id).state == "drained"
        assert registry.drain_worker(conn, worker_id).state == "drained", "draining again changes nothing"


def test_two_proxy_replicas_send_a_conversations_follow_ups_to_the_same_worker(database_url):
    sims = [sim_worker("h200", time_scale=20.0) for _ in range(3)]
    fleet = make_fleet(database_url, [s.url for s in sims])
    with serving(database_url, PARALON_CAPACITY_PERIOD_MS="1000") as one, \
            serving(database_url, PARALON_CAPACITY_PERIOD_MS="1000") as two:
        clients = [openai.OpenAI(base_url=p.url + "/v1", api_key=fleet.key, max_retries=0) for p in (one, two)]
        for i in range(45):  # a probe period: every worker is measured, and the measurement shared
            clients[0].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"warm {i}"}], max_tokens=20)
        wait_for(lambda: all(fleet.worker(w).throughput_tokens_per_s for w in fleet.worker_ids))
        time.sleep(0.5)  # both replicas have read it
        served_by: dict[int, set[int]] = {}
        for conversation in range(16):
            messages = [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": f"Question number {conversation}?"}]
            for turn in range(3):
                proxy = (one, two)[(conversation + turn) % 2]
                answer = clients[(conversation + turn) % 2].chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
                served_by.setdefault(conversation, set()).add(_worker_of(proxy, fleet, answer.id))
                messages = messages + [{"role": "assistant", "content": answer.choices[0].message.content},
                                       {"role": "user", "content": f"And then ({turn})?"}]
    for s in sims:
        s.stop()
    assert all(len(workers) == 1 for workers in served_by.values()), served_by
    assert len(set().union(*served_by.values())) >= 2, "conversations spread over the fleet"
