"""Billing under pressure: concurrency against a small balance, callers that
leave, workers that fail or inflate their usage, spend limits."""
from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import httpx
import openai
import orjson
import pytest
from sqlalchemy import select

from ledger.holds import expired_captures
from ledger.schema import holds, utc_now
from ledger.store import append_batch
from proxy.schema import workers
from tests.support.harness import MODEL, lowest_available_watched, make_fleet, serving, sim_worker, wait_for

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def _headers(fleet) -> dict:
    return {"authorization": f"Bearer {fleet.key}", "content-type": "application/json"}


def test_200_concurrent_streams_against_credits_for_about_20(database_url):
    """Given credits for about 20 requests, when 200 stream at once, then
    available never goes below zero, every completed request is charged once,
    and the owner gets charge*80//100 of each."""
    worker = sim_worker("h200", time_scale=4.0)
    # A request: prompt bound 53 tokens at 150 + 40 tokens at 600 = 31,950 nano-USD held.
    fleet = make_fleet(database_url, [worker.url], credits_usd="0.00060")
    with serving(database_url) as proxy:
        async def main():
            client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0, timeout=120)

            async def one(i):
                try:
                    stream = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"story {i:03d}"}], max_tokens=40,
                        stream=True, stream_options={"include_usage": True})
                    chunks = [c async for c in stream]
                    return chunks[-1].id, chunks[-1].usage
                except openai.APIStatusError as exc:
                    return None, exc.status_code

            results = await asyncio.gather(*(one(i) for i in range(200)))
            await client.close()
            return results

        with lowest_available_watched(fleet) as lowest:
            results = asyncio.run(main())
    worker.stop()

    completed = {rid: usage for rid, usage in results if rid is not None}
    refused = [status for rid, status in results if rid is None]
    assert set(refused) <= {402} and len(completed) + len(refused) == 200
    assert 10 <= len(completed) < 200, "credits for about 20: some served, most refused"
    assert min(lowest) >= 0
    settled = {s["request_id"]: s for s in fleet.settlements()}
    charged = {rid for rid, usage in completed.items() if usage.completion_tokens}
    assert set(settled) == charged, "each completed request charged exactly once, nothing else"
    for rid in charged:
        assert settled[rid]["charge_nano_usd"] == completed[rid].model_extra["cost_details"]["nano_usd"]
    customer = fleet.balance(fleet.customer_id)
    assert customer.held_nano_usd == 0 and customer.available_nano_usd >= 0
    assert customer.balance_nano_usd == 600_000 - sum(s["charge_nano_usd"] for s in settled.values())
    fleet.assert_books_close()


def test_a_caller_that_disconnects_is_billed_for_what_was_produced(database_url):
    worker = sim_worker("h200", time_scale=1.0)
    fleet = make_fleet(database_url, [worker.url])
    with serving(database_url) as proxy:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, headers=_headers(fleet), timeout=30) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events += 1
                if events >= 6:
                    break
        wait_for(lambda: worker.app.state.requests_aborted == 1)
        settled = wait_for(fleet.settlements)
    worker.stop()
    assert len(settled) == 1
    produced = settled[0]["meta"]["completion_tokens"]
    assert 5 <= produced < 400, "billed what was produced, not max_tokens"
    assert fleet.balance(fleet.customer_id).held_nano_usd == 0
    fleet.assert_books_close()


def test_a_worker_that_dies_mid_stream_bills_what_the_streaming_caller_received(database_url):
    """Given a worker that dies after 5 tokens, a streaming caller keeps those
    tokens and pays exactly for them (the owner gets 80%); a non-streaming
    caller received nothing and pays nothing."""
    worker = sim_worker("instant", fail_after_tokens=5)  # the worker's own failure, not the caller's doing
    fleet = make_fleet(database_url, [worker.url])
    before = fleet.balance(fleet.customer_id)
    with serving(database_url) as proxy:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=_headers(fleet), timeout=30)
        chunks = [orjson.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        assert "error" in chunks[-1], "the caller is told the stream failed"
        received = sum(1 for c in chunks[:-1] for choice in c.get("choices", []) if choice["delta"].get("content"))
        prompt_tokens = chunks[-2]["usage"]["prompt_tokens"]
        failed_whole = httpx.post(proxy.url + "/v1/chat/completions", json={**body, "stream": False},
                                  headers=_headers(fleet), timeout=30)
        assert failed_whole.status_code >= 500
    worker.stop()
    assert received == 5
    [settled] = fleet.settlements()
    assert settled["request_id"] == chunks[0]["id"], "only the stream is charged"
    assert settled["meta"]["completion_tokens"] == 5 and settled["meta"]["prompt_tokens"] == prompt_tokens
    assert settled["charge_nano_usd"] == prompt_tokens * 150 + 5 * 600
    assert settled["owner_nano_usd"] == settled["charge_nano_usd"] * 80 // 100
    after = fleet.balance(fleet.customer_id)
    assert after.held_nano_usd == 0
    assert after.balance_nano_usd == before.balance_nano_usd - settled["charge_nano_usd"]
    fleet.assert_books_close()


def test_a_failure_before_the_first_token_is_retried_on_another_worker(database_url):
    good = sim_worker("instant")
    fleet = make_fleet(database_url, ["http://127.0.0.1:9", good.url])  # port 9: nothing listens
    with fleet.engine.begin() as conn:  # both look healthy to routing until the dead one is probed
        conn.execute(workers.update().values(healthy=True, context_length=32768))
    with serving(database_url, PARALON_HEALTH_INTERVAL_MS="60000") as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        answers = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=3)
                   for i in range(6)]
    good.stop()
    assert all(a.usage.completion_tokens == 3 for a in answers)
    settled = fleet.settlements()
    assert len(settled) == 6 and {s["owner_account_id"] for s in settled} == {fleet.owner_ids[1]}
    assert fleet.balance(fleet.owner_ids[0]).balance_nano_usd == 0
    fleet.assert_books_close()


def test_a_worker_inflating_its_usage_is_billed_the_count_and_then_suspended(database_url):
    # 10 words of about 6 bytes relayed: a report of 10x is above any byte-level count of them.
    honest, inflating = sim_worker("instant"), sim_worker("instant", inflate_usage=10)
    fleet = make_fleet(database_url, [honest.url, inflating.url])
    with serving(database_url) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        for i in range(40):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"conversation {i}"}], max_tokens=10)
        suspended = wait_for(lambda: fleet.worker(fleet.worker_ids[1]).state == "suspended")
        served_after = len(fleet.settlements())
        for i in range(10):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"later {i}"}], max_tokens=10)
    honest.stop(), inflating.stop()
    assert suspended
    settled = fleet.settlements()
    by_inflater = [s for s in settled if s["owner_account_id"] == fleet.owner_ids[1]]
    assert by_inflater and all(s["meta"]["completion_tokens"] == 10 for s in by_inflater), "billed what was counted"
    assert fleet.events("UsageDiscrepancyRecorded") == len(by_inflater) >= 3
    assert all(s["owner_account_id"] == fleet.owner_ids[0] for s in settled[served_after:]), "no traffic once suspended"
    fleet.assert_books_close()


def test_a_key_with_a_spend_limit_gets_429_once_it_is_spent(database_url):
    worker = sim_worker("instant")
    # Each request costs prompt*150 + 10*600 = about 6,600 nano-USD; the limit covers about 3.
    fleet = make_fleet(database_url, [worker.url], spend_limit_usd="0.00002")
    with serving(database_url) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
        statuses = []
        for i in range(8):
            try:
                answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10)
                statuses.append(200)
                # A hold capped by the limit clamps max_tokens, even when the request
                # went upstream before its hold was confirmed: what is relayed is billed.
                assert len(answer.choices[0].message.content.split()) == answer.usage.completion_tokens
            except openai.APIStatusError as exc:
                statuses.append(exc.status_code)
                assert exc.body["type"] == exc.body["code"] == "insufficient_quota"
    worker.stop()
    assert statuses[0] == 200 and statuses[-1] == 429 and set(statuses) == {200, 429}
    spent = sum(s["charge_nano_usd"] for s in fleet.settlements())
    assert spent <= 20_000, "the limit held"
    fleet.assert_books_close()


@pytest.mark.parametrize("credits_usd", ["0"])
def test_no_credits_is_402_and_moves_nothing(database_url, credits_usd):
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url], credits_usd=credits_usd)
    with serving(database_url) as proxy:
        response = httpx.post(proxy.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                              headers=_headers(fleet))
    worker.stop()
    assert response.status_code == 402 and response.json()["error"]["code"] == "insufficient_credits"
    assert fleet.settlements() == [] and fleet.balance(fleet.customer_id).held_nano_usd == 0


def test_a_proxy_killed_mid_stream_leaves_a_hold_that_settles_at_what_the_caller_received(database_url):
    """Given a proxy killed (-9) three seconds into a stream, its hold expires
    and the sweeper of another proxy settles it at the usage last recorded
    against it: the caller pays for tokens it received, at most all of them
    and at least all but the last two seconds' worth, and the owner gets 80%."""
    worker = sim_worker("h200", time_scale=0.25)  # about 40 tokens a second
    fleet = make_fleet(database_url, [worker.url])
    before = fleet.balance(fleet.customer_id).balance_nano_usd
    received = 0
    with serving(database_url, PARALON_HOLD_TTL_S="2") as doomed:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", doomed.url + "/v1/chat/completions", json=body, headers=_headers(fleet), timeout=30) as response:
            started = time.monotonic()
            try:
                for line in response.iter_lines():
                    received += line.startswith("data: {")
                    if time.monotonic() - started > 3 and doomed.process.poll() is None:
                        doomed.process.kill()  # no finally, no settlement, no release
            except httpx.HTTPError:
                pass
        doomed.process.wait(10)
    assert fleet.balance(fleet.customer_id).held_nano_usd > 0
    with serving(database_url, PARALON_HOLD_SWEEP_INTERVAL_MS="200"):
        wait_for(lambda: fleet.balance(fleet.customer_id).held_nano_usd == 0, timeout_s=15)
    worker.stop()
    [settled] = fleet.settlements()
    billed = settled["meta"]["completion_tokens"]
    assert received - 2 * 45 <= billed <= received, (billed, received)
    assert settled["charge_nano_usd"] == settled["meta"]["prompt_tokens"] * 150 + billed * 600
    assert fleet.balance(fleet.customer_id).balance_nano_usd == before - settled["charge_nano_usd"]
    fleet.assert_books_close()


def test_tokens_past_max_tokens_are_never_relayed_nor_billed(database_url):
    """A worker that ignores max_tokens: the caller gets what the hold pays for, and no more."""
    worker = sim_worker("instant", extra_tokens=20)
    fleet = make_fleet(database_url, [worker.url])
    with serving(database_url) as proxy:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=_headers(fleet), timeout=30)
    worker.stop()
    events = [orjson.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    relayed = [e for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")]
    assert len(relayed) == 5 and events[-1]["usage"]["completion_tokens"] == 5
    assert [s["meta"]["completion_tokens"] for s in fleet.settlements()] == [5]
    fleet.assert_books_close()


def test_a_caller_leaving_after_the_last_token_is_still_billed_once(database_url):
    """The settlement runs in its own task: a disconnect right at the end cannot skip it."""
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url])
    with serving(database_url) as proxy:
        for i in range(10):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 3, "stream": True}
            with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, headers=_headers(fleet), timeout=30) as r:
                for line in r.iter_lines():
                    if '"finish_reason":"length"' in line:
                        break  # leave before [DONE]
        settled = wait_for(lambda: len(fleet.settlements()) == 10 and fleet.settlements())
    worker.stop()
    assert all(s["meta"]["completion_tokens"] == 3 for s in settled)
    wait_for(lambda: fleet.balance(fleet.customer_id).held_nano_usd == 0)
    fleet.assert_books_close()


def _stream_words(url: str, fleet, body: dict, after_words: int, meanwhile) -> tuple[int, list[dict]]:
    """Stream, call `meanwhile()` once `after_words` words arrived, read to the end;
    returns (words received, the chunks)."""
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=_headers(fleet), timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(orjson.loads(line[6:]))
                if sum(1 for c in chunks for ch in c.get("choices", []) if ch["delta"].get("content")) == after_words:
                    meanwhile()
    words = sum(1 for c in chunks for ch in c.get("choices", []) if ch["delta"].get("content"))
    return words, chunks


def test_a_hold_the_sweeper_took_mid_stream_is_charged_in_full_without_a_second_charge(database_url):
    """Given a stream whose hold the sweeper settles at its recorded usage
    while the stream still runs (its proxy could not renew it in time), the
    stream stops, and its own settlement charges exactly the rest: the two
    charges add up to what the caller received, the owner gets 80% of each."""
    worker = sim_worker("h200", time_scale=0.5)  # about 85 tokens a second
    fleet = make_fleet(database_url, [worker.url])
    before = fleet.balance(fleet.customer_id).balance_nano_usd

    def sweep_as_if_expired():
        def delivered_recorded() -> bool:  # a renewal has recorded what was delivered
            with fleet.engine.connect() as conn:
                return bool(conn.execute(select(holds.c.capture_nano_usd).where(holds.c.capture_nano_usd > 0)).first())

        wait_for(delivered_recorded, timeout_s=10)
        with fleet.engine.begin() as conn:
            due = expired_captures(conn, now=utc_now() + timedelta(hours=1))
            assert len(due) == 1 and all(not isinstance(r, Exception) for r in append_batch(conn, due))

    with serving(database_url) as proxy:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "stream": True,
                "stream_options": {"include_usage": True}}
        words, chunks = _stream_words(proxy.url, fleet, body, 5, sweep_as_if_expired)
        generation = httpx.get(f"{proxy.url}/v1/generations/{chunks[-1]['id']}", headers=_headers(fleet), timeout=10).json()
    worker.stop()
    assert 5 < words < 2000, "cut once its hold was gone"
    settled = fleet.settlements()
    assert len(settled) == 2, "the sweeper's settlement, then the rest"
    first, rest = settled
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    total = first["charge_nano_usd"] + rest["charge_nano_usd"]
    assert total == prompt_tokens * 150 + words * 600 == generation["cost_nano_usd"]
    assert first["meta"]["completion_tokens"] + rest["meta"]["completion_tokens"] == words
    assert fleet.balance(fleet.customer_id).balance_nano_usd == before - total
    assert fleet.balance(fleet.customer_id).held_nano_usd == 0
    fleet.assert_books_close()


_REFUSE_SETTLEMENTS = {
    "sqlite": ["CREATE TRIGGER refuse_settlements BEFORE INSERT ON ledger_events WHEN NEW.event_type = 'RequestSettled' "
               "BEGIN SELECT RAISE(ABORT, 'settlements refused'); END"],
    "postgresql": ["CREATE FUNCTION refuse_settlements() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                   "IF NEW.event_type = 'RequestSettled' THEN RAISE EXCEPTION 'settlements refused'; END IF; RETURN NEW; END $$",
                   "CREATE TRIGGER refuse_settlements BEFORE INSERT ON ledger_events FOR EACH ROW EXECUTE FUNCTION refuse_settlements()"],
}


def test_a_stream_whose_charge_cannot_be_written_is_settled_later_by_the_sweeper(database_url):
    """Given the database refusing a stream's settlement when it ends, the
    delivered tokens are not given away: the hold keeps the full charge and
    the sweeper settles it once it expires. A non-streaming caller in the same
    position gets 503 and pays nothing."""
    worker = sim_worker("h200", time_scale=2.0)
    fleet = make_fleet(database_url, [worker.url])
    before = fleet.balance(fleet.customer_id).balance_nano_usd

    def refuse_settlements() -> None:
        with fleet.engine.begin() as conn:
            for statement in _REFUSE_SETTLEMENTS[fleet.engine.dialect.name]:
                conn.exec_driver_sql(statement)

    with serving(database_url, PARALON_HOLD_TTL_S="2", PARALON_HOLD_SWEEP_INTERVAL_MS="200") as proxy:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "stream": True,
                "stream_options": {"include_usage": True}}
        words, chunks = _stream_words(proxy.url, fleet, body, 20, refuse_settlements)
        whole = httpx.post(proxy.url + "/v1/chat/completions", json={**body, "stream": False}, headers=_headers(fleet), timeout=30)
        assert fleet.settlements() == [], "refused while the trigger stands"
        with fleet.engine.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER refuse_settlements" + (" ON ledger_events" if fleet.engine.dialect.name == "postgresql" else ""))
        wait_for(lambda: fleet.balance(fleet.customer_id).held_nano_usd == 0, timeout_s=15)
    worker.stop()
    assert whole.status_code == 503 and "withheld" in whole.json()["error"]["message"]
    [settled] = fleet.settlements()
    assert settled["request_id"] == chunks[0]["id"] and words == 40
    assert settled["charge_nano_usd"] == chunks[-1]["usage"]["prompt_tokens"] * 150 + 40 * 600
    assert fleet.balance(fleet.customer_id).balance_nano_usd == before - settled["charge_nano_usd"]
    fleet.assert_books_close()
