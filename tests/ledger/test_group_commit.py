"""The group-commit writer: batching, per-command results, retries and limits."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ledger import commands as cmd
from ledger.accounts import create_account
from ledger.db import APPEND_MARKS
from ledger.errors import InsufficientFunds, WriterClosed, WriterOverloaded
from ledger.events import GENESIS_HASH
from ledger.group_commit import GroupCommitWriter
from ledger.holds import PlaceHold
from ledger.money import NANO_USD_PER_USD as USD
from ledger.schema import ledger_head
from ledger.store import append_batch
from tests.ledger.helpers import customer_with, key


class _Gate:
    """Holds the writer inside its first batch until the test opens it."""

    def __init__(self, apply):
        self.entered, self.open, self.apply = threading.Event(), threading.Event(), apply

    def __call__(self, conn, commands):
        self.entered.set()
        self.open.wait()
        return self.apply(conn, commands)


def test_each_caller_gets_its_own_result_from_one_shared_transaction(engine):
    seen_batches = []

    def apply(conn, commands):
        seen_batches.append(list(commands))
        return [InsufficientFunds("odd") if c % 2 else c * 10 for c in commands]

    gate = _Gate(apply)
    writer = GroupCommitWriter(engine, gate, batch_size_max=8, batch_wait_ms=0)
    first = writer.submit(0)
    gate.entered.wait()  # the writer is inside the first batch; the rest queue up
    futures = [writer.submit(i) for i in range(1, 10)]
    gate.open.set()
    assert first.result() == 0
    for i, future in enumerate(futures, start=1):
        if i % 2:
            with pytest.raises(InsufficientFunds):
                future.result()
        else:
            assert future.result() == i * 10
    writer.close()
    assert [len(b) for b in seen_batches] == [1, 8, 1]  # bounded by batch_size_max
    assert writer.batches_committed == 3 and writer.commands_committed == 10


def test_a_unique_key_race_is_retried_and_a_bug_fails_only_its_batch(engine):
    calls = []

    def apply(conn, commands):
        calls.append(commands)
        if len(calls) == 1:  # as if another process inserted the same key first: the database refuses it
            conn.execute(ledger_head.insert().values(id=1, last_seq=0, last_hash=GENESIS_HASH))
        if commands == ["boom"]:
            raise RuntimeError("a bug")
        return ["ok"] * len(commands)

    writer = GroupCommitWriter(engine, apply, batch_wait_ms=0)
    assert writer.execute("first") == "ok"  # failed once with a unique violation, then retried
    assert len(calls) == 2
    with pytest.raises(RuntimeError):
        writer.execute("boom")
    assert writer.execute("after") == "ok"  # the writer keeps serving
    writer.close()
    assert writer.commands_committed == 2


def test_a_full_queue_refuses_at_once_and_a_closed_writer_refuses(engine):
    gate = _Gate(lambda conn, commands: list(commands))
    writer = GroupCommitWriter(engine, gate, batch_size_max=1, queue_depth_max=2, batch_wait_ms=0)
    taken = writer.submit("taken by the writer")
    gate.entered.wait()
    queued = [writer.submit("a"), writer.submit("b")]
    with pytest.raises(WriterOverloaded):
        writer.submit("c")

    async def refused_from_the_loop() -> BaseException | None:
        return writer.submit_async("c").exception()  # a failed future, as any other result, not a raise
    assert isinstance(asyncio.run(refused_from_the_loop()), WriterOverloaded)
    gate.open.set()
    assert taken.result() == "taken by the writer" and [f.result() for f in queued] == ["a", "b"]
    writer.close()
    with pytest.raises(WriterClosed):
        writer.submit("late")
    with pytest.raises(ValueError):
        GroupCommitWriter(engine, lambda conn, commands: commands, batch_size_max=0)


def test_the_appender_counts_the_time_it_held_the_append_lock_and_the_holds_writer_counts_none(ledger):
    started = time.perf_counter()
    customer = customer_with(ledger, 10 * USD)
    elapsed_s = time.perf_counter() - started
    held_s = ledger.appender.append_lock_held_s
    assert 0 < held_s <= elapsed_s, "the lock is held for part of the append, never longer"
    ledger.place_hold(PlaceHold(customer, USD, key("hold")))
    with pytest.raises(InsufficientFunds):  # refused under the lock: the lock was held all the same
        ledger.append(cmd.AdjustBalance(customer, -20 * USD, "too much", key("adjust")))
    assert ledger.appender.append_lock_held_s > held_s
    assert ledger.holder.append_lock_held_s == 0.0 and ledger.holder.append_lock_parts_s == {}


def test_the_lock_held_is_split_into_the_chain_the_write_and_the_commit_which_add_up_to_it(ledger):
    started = time.perf_counter()
    customer = customer_with(ledger, 10 * USD)
    with pytest.raises(InsufficientFunds):  # refused under the lock: nothing written, chained and committed all the same
        ledger.append(cmd.AdjustBalance(customer, -20 * USD, "too much", key("adjust")))
    parts = ledger.appender.append_lock_parts_s
    assert set(parts) == {"chained", "written", "committed"} and all(s > 0 for s in parts.values())
    assert sum(parts.values()) == pytest.approx(ledger.appender.append_lock_held_s, rel=1e-9)
    assert ledger.appender.append_lock_held_s <= time.perf_counter() - started, "each part is a stretch of the appends' own time"


def test_appends_outside_a_writer_keep_only_their_last_marks_on_the_connection(engine):
    """A connection's `info` outlives its checkouts: marks nobody counts must not pile up."""
    with engine.begin() as conn:
        customer = create_account(conn, cmd.CUSTOMER, "customer")
    with engine.connect() as conn:
        for i in range(5):
            with conn.begin():
                append_batch(conn, [cmd.GrantCredits(customer, USD, "credits", key(f"grant{i}"))])
            assert [moment for moment, _ in conn.info[APPEND_MARKS]] == ["lock_taken", "chained", "written"]


def test_a_batch_stops_waiting_for_more_once_nothing_arrived_for_its_quiet_time(engine):
    """With a minute to wait for company, the batch still goes once no
    command arrived for its quiet time: the callers that were coming have queued."""
    writer = GroupCommitWriter(engine, lambda conn, commands: list(commands), batch_wait_ms=60_000, batch_quiet_ms=50)
    try:
        assert writer.submit("alone").result(timeout=30) == "alone"  # waited 50 ms, not a minute
    finally:
        writer.close()


def test_commands_arriving_within_the_quiet_time_join_the_batch_they_kept_waiting(engine):
    batches = []

    def apply(conn, commands):
        batches.append(list(commands))
        return list(commands)

    writer = GroupCommitWriter(engine, apply, batch_wait_ms=60_000, batch_quiet_ms=3_000)
    try:
        futures = [writer.submit("first")]
        for i in range(3):  # each well inside the quiet time of the one before
            time.sleep(0.05)
            futures.append(writer.submit(f"then-{i}"))
        assert [f.result(timeout=30) for f in futures] == ["first", "then-0", "then-1", "then-2"]
    finally:
        writer.close()
    assert batches == [["first", "then-0", "then-1", "then-2"]]
