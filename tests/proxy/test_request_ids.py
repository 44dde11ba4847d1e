"""Request ids sort in the order they were made (the time in milliseconds
first): each request's hold and settlement keys then go in at the right edge
of their unique indexes."""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from sqlalchemy import select

from ledger.schema import ledger_events
from proxy import request_ids
from proxy.request_ids import new_request_id
from tests.support.harness import MODEL, make_fleet, serving, sim_worker

ID_HEX = re.compile(r"chatcmpl-([0-9a-f]{32})")
MS_HEX_DIGITS = 12  # an id starts with the Unix time in milliseconds, 48 bits


def _ms_of(request_id: str) -> int:
    return int(ID_HEX.fullmatch(request_id).group(1)[:MS_HEX_DIGITS], 16)


def test_ids_keep_their_prefix_and_carry_the_time_they_were_made():
    before_ms = time.time_ns() // 1_000_000
    request_id = new_request_id("chatcmpl-")
    after_ms = time.time_ns() // 1_000_000
    assert ID_HEX.fullmatch(request_id), request_id
    assert before_ms <= _ms_of(request_id) <= after_ms
    assert new_request_id("resp_").startswith("resp_") and new_request_id("embd-").startswith("embd-")


def test_ids_of_a_later_millisecond_sort_after_earlier_ones_and_none_repeats():
    ids = []
    for _ in range(3):  # across several milliseconds, and many within one (those sort among themselves at random)
        ids += [new_request_id("chatcmpl-") for _ in range(2000)]
        time.sleep(0.002)
    made_ms = [_ms_of(i) for i in ids]
    assert made_ms == sorted(made_ms) and len(set(made_ms)) >= 3
    assert all(a < b for a, b, a_ms, b_ms in zip(ids, ids[1:], made_ms, made_ms[1:]) if a_ms < b_ms)
    assert len(set(ids)) == len(ids)


def test_ids_made_fast_keep_to_the_clock():
    """Many ids in one millisecond do not push their time ahead of the clock
    (as a generator that adds a millisecond to keep each id above the last would)."""
    ids = [new_request_id("chatcmpl-") for _ in range(20_000)]
    assert _ms_of(ids[-1]) <= time.time_ns() // 1_000_000


def test_the_random_bits_are_read_from_the_system_once_for_many_ids(monkeypatch):
    """`os.urandom` hands the interpreter to other threads: one read serves many ids."""
    reads = []
    real_urandom = os.urandom
    monkeypatch.setattr(request_ids.os, "urandom", lambda n: reads.append(n) or real_urandom(n))
    ids = [new_request_id("chatcmpl-") for _ in range(1000)]
    assert 1 <= len(reads) <= len(ids) // 100 and len(set(ids)) == len(ids)


def test_a_forked_child_makes_ids_of_its_own_not_its_parents_next_ones():
    new_request_id("chatcmpl-")  # the parent holds random bytes not used yet
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        try:
            os.write(write_end, "".join(new_request_id("") for _ in range(8)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        from_child = pipe.read()
    os.waitpid(child, 0)
    from_parent = [new_request_id("") for _ in range(8)]
    child_random = {from_child[i * 32 + MS_HEX_DIGITS:(i + 1) * 32] for i in range(8)}
    assert len(child_random) == 8 and not child_random & {i[MS_HEX_DIGITS:] for i in from_parent}


def test_a_child_forked_while_another_thread_held_the_lock_still_makes_ids():
    with request_ids._lock:  # as another thread of the parent might, at the fork
        child = os.fork()
        if child == 0:  # pragma: no cover (the child)
            try:
                new_request_id("chatcmpl-")
            finally:
                os._exit(0)
    deadline_s = time.monotonic() + 10
    while not (done := os.waitpid(child, os.WNOHANG))[0]:
        if time.monotonic() > deadline_s:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the forked child waited for ever for a lock its parent's thread held")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_the_proxys_requests_settle_under_keys_in_the_order_they_came(database_url):
    """Three requests one after another: their answers' ids are the request
    ids, and the settlements' keys in the log sort as the requests came."""
    worker = sim_worker("instant")
    fleet = make_fleet(database_url, [worker.url])
    answered = []
    with serving(database_url) as proxy:
        for _ in range(3):
            response = httpx.post(proxy.url + "/v1/chat/completions", timeout=30,
                                  headers={"authorization": f"Bearer {fleet.key}"},
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
            assert response.status_code == 200, response.text
            answered.append(response.json()["id"])
            time.sleep(0.002)
    worker.stop()
    assert all(ID_HEX.fullmatch(i) for i in answered) and answered == sorted(answered)
    with fleet.engine.connect() as conn:
        keys = conn.execute(select(ledger_events.c.idempotency_key).where(ledger_events.c.event_type == "RequestSettled")
                            .order_by(ledger_events.c.seq)).scalars().all()
    assert keys == [f"settle:{i}" for i in answered] and keys == sorted(keys)
    fleet.assert_books_close()
