"""Concurrency on PostgreSQL: separate transactions racing for one account, one
key, and the order in which a consumer sees the log."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select, text

from ledger import commands as cmd
from ledger import spend_limits
from ledger.db import snapshot_connection
from ledger.errors import InsufficientFunds, SpendLimitReached
from ledger.holds import PlaceHold, place_holds
from ledger.log import consume_once
from ledger.schema import ledger_events
from ledger.service import Ledger, append_now
from ledger.store import append_batch, set_postings_in_event_row
from ledger.verify import verify
from tests.ledger.helpers import customer_with, keep_granting, key, money_snapshot, wait_until_a_session_waits_for_a_lock
from tests.support.harness import wait_for

HOLD = 1_000_000


def _race(count: int, work):
    """Run `work(i)` in `count` threads released at the same instant."""
    barrier = threading.Barrier(count)

    def start(i):
        barrier.wait()
        try:
            return work(i)
        except Exception as exc:  # the outcome, not a crash
            return exc

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(start, range(count)))


def test_50_concurrent_holds_on_one_account_never_overdraw(pg_engine):
    ledger = Ledger(pg_engine)
    customer = customer_with(ledger, 20 * HOLD + HOLD // 2)  # room for 20 holds, not 21
    before = money_snapshot(pg_engine)["balances"]

    def one_hold(i):
        with pg_engine.begin() as conn:
            [result] = place_holds(conn, [PlaceHold(customer, HOLD, f"race-hold-{i}")])
        if isinstance(result, Exception):
            raise result
        return result

    outcomes = _race(50, one_hold)
    placed = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(placed) == 20
    assert [o for o in refused if not isinstance(o, InsufficientFunds)] == [] and len(refused) == 30
    view = ledger.balance(customer)
    assert view.held_nano_usd == 20 * HOLD
    assert view.available_nano_usd == HOLD // 2
    assert money_snapshot(pg_engine)["balances"] == before  # holds move no money
    ledger.close()


def test_holds_from_several_replicas_at_once_never_overdraw(pg_engine):
    replicas = [Ledger(pg_engine) for _ in range(5)]
    customer = customer_with(replicas[0], 7 * HOLD)
    outcomes = _race(40, lambda i: replicas[i % 5].place_hold(PlaceHold(customer, HOLD, f"replica-hold-{i}")))
    assert sum(not isinstance(o, Exception) for o in outcomes) == 7
    assert replicas[0].balance(customer).available_nano_usd == 0
    for replica in replicas:
        replica.close()


def test_20_concurrent_callers_with_one_key_have_one_effect(pg_engine):
    ledger = Ledger(pg_engine)
    customer = customer_with(ledger, 0)
    grant = cmd.GrantCredits(customer, 5 * HOLD, "once", "the-one-key")
    outcomes = _race(20, lambda i: append_now(pg_engine, grant))
    assert not [o for o in outcomes if isinstance(o, Exception)], outcomes
    assert sorted(o.status for o in outcomes) == ["created"] + ["exists"] * 19
    assert len({o.seq for o in outcomes}) == 1
    assert ledger.balance(customer).balance_nano_usd == 5 * HOLD
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(ledger_events).where(ledger_events.c.idempotency_key == "the-one-key")).scalar_one() == 1
    ledger.close()


def test_one_settlement_key_from_several_replicas_settles_once(pg_engine):
    replicas = [Ledger(pg_engine) for _ in range(4)]
    customer = customer_with(replicas[0], 10 * HOLD)
    owner = replicas[0].create_account(cmd.OWNER, "gpu owner")
    hold = replicas[0].place_hold(PlaceHold(customer, HOLD, key("hold")))
    settle = cmd.SettleRequest(hold.hold_id, owner, HOLD // 3, "req-1", "settle-req-1", {"model": "m"})
    outcomes = _race(20, lambda i: replicas[i % 4].append(settle))
    assert not [o for o in outcomes if isinstance(o, Exception)], outcomes
    assert sorted(o.status for o in outcomes) == ["created"] + ["exists"] * 19
    assert replicas[0].balance(customer).balance_nano_usd == 10 * HOLD - HOLD // 3
    assert replicas[0].balance(owner).balance_nano_usd == (HOLD // 3) * 80 // 100
    for replica in replicas:
        replica.close()


def test_a_consumer_never_skips_an_event_that_commits_late(pg_engine):
    """Appenders hold their transactions open for random times after taking a
    sequence number; a consumer polling all along must see every event once, in order."""
    ledger = Ledger(pg_engine)
    customer = customer_with(ledger, 0)
    appenders, per_appender = 8, 6
    done = threading.Event()
    seen: list[int] = []

    def append_slowly(worker: int):
        rng = random.Random(worker)
        for n in range(per_appender):
            with pg_engine.begin() as conn:
                [result] = append_batch(conn, [cmd.GrantCredits(customer, 1, "late", f"late-{worker}-{n}")])
                time.sleep(rng.uniform(0, 0.05))  # committed late, after others may have queued
            assert result.status == "created"

    def consume():
        while not done.is_set():
            consume_once(pg_engine, "late-commit-test", lambda conn, page: seen.extend(e.seq for e in page), page_size=3)

    consumer = threading.Thread(target=consume)
    consumer.start()
    with ThreadPoolExecutor(max_workers=appenders) as pool:
        list(pool.map(append_slowly, range(appenders)))
    done.set()
    consumer.join()
    while consume_once(pg_engine, "late-commit-test", lambda conn, page: seen.extend(e.seq for e in page)):
        pass
    with pg_engine.connect() as conn:
        last = conn.execute(select(func.max(ledger_events.c.seq))).scalar_one()
    assert seen == list(range(1, last + 1))
    ledger.close()


def test_a_hold_does_not_wait_for_an_unflushed_settlement_of_the_same_customer(pg_engine):
    """A settlement holding the append lock and its rows (as while it waits for
    its flush) does not block a new hold on the same customer."""
    ledger = Ledger(pg_engine)
    customer = customer_with(ledger, 10 * HOLD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    hold = ledger.place_hold(PlaceHold(customer, HOLD, key("hold")))
    settling = pg_engine.connect()
    transaction = settling.begin()
    [settled] = append_batch(settling, [cmd.SettleRequest(hold.hold_id, owner, HOLD, "r", key(), {})])
    assert settled.status == "created"
    try:
        with pg_engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL lock_timeout = '5s'")  # a wait on any lock would raise
            [new_hold] = place_holds(conn, [PlaceHold(customer, 9 * HOLD, key("hold"))])
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "off"
        assert new_hold.status == "created"  # 10 - 1 held: the settlement is not yet visible
    finally:
        transaction.commit()
        settling.close()
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (9 * HOLD, 9 * HOLD)
    with pg_engine.begin() as conn:
        append_batch(conn, [cmd.GrantCredits(customer, 1, "durable", key())])
        assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
    ledger.close()


def test_a_hold_sees_a_debit_committed_while_it_waited_for_its_customer(pg_engine):
    """A refund locks its customer's row of placed holds until it commits; a
    hold placed meanwhile waits for that lock, then must decide on the balance
    after the refund, not on the one its first read saw (migration 0037 reads
    after the lock, in a statement of its own)."""
    ledger = Ledger(pg_engine)
    customer = customer_with(ledger, 10 * HOLD)
    refunding = pg_engine.connect()
    transaction = refunding.begin()
    try:
        [refunded] = append_batch(refunding, [cmd.RefundCredits(customer, 6 * HOLD, "card", "re_1", "external:stripe", key())])
        assert refunded.status == "created"
        answer = _placed_once_waiting_for(pg_engine, transaction, PlaceHold(customer, 5 * HOLD, key("hold")))
    finally:
        refunding.close()
    assert isinstance(answer, InsufficientFunds), answer
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (4 * HOLD, 0), "no hold beyond what the refund left"
    ledger.close()


def _placed_once_waiting_for(pg_engine, transaction, request: PlaceHold):
    """`request` placed in a transaction of its own while `transaction` is open:
    once the placement waits for a lock, `transaction` commits; the placement's answer."""
    with ThreadPoolExecutor(1) as pool:
        def place():
            with pg_engine.begin() as conn:
                return place_holds(conn, [request])
        waiting = pool.submit(place)
        wait_until_a_session_waits_for_a_lock(pg_engine)
        transaction.commit()
        [answer] = waiting.result(timeout=30)
    return answer


@pytest.fixture(autouse=True)
def _postgres_only(pg_engine):
    assert pg_engine.dialect.name == "postgresql"


def test_40_concurrent_holds_from_separate_processes_never_overshoot_a_key_limit(pg_engine):
    """Like the balance: replicas racing for one spend limit are granted at most the limit in all."""
    customer = customer_with(Ledger(pg_engine), 100 * HOLD)
    with pg_engine.begin() as conn:
        spend_limits.create_limit(conn, 5, 10 * HOLD)
    replicas = [Ledger(pg_engine) for _ in range(4)]
    try:
        results = _race(40, lambda i: replicas[i % 4].place_hold(
            PlaceHold(customer, HOLD, key("hold"), minimum_nano_usd=HOLD // 2, spend_limit_id=5)))
    finally:
        for replica in replicas:
            replica.close()
    granted = sum(r.amount_nano_usd for r in results if not isinstance(r, Exception))
    assert granted == 10 * HOLD
    assert all(isinstance(r, SpendLimitReached) for r in results if isinstance(r, Exception))
    with pg_engine.connect() as conn:
        assert spend_limits.read_limits(conn, [5])[5]["held_nano_usd"] == 10 * HOLD


def test_two_customers_holding_against_one_limit_wait_for_each_other_and_never_overshoot_it(pg_engine):
    """Holds of two customers naming one spend limit share no customer's lock:
    the limit's own lock makes the second wait for the first to commit, and
    decide on what the first placed (migration 0037 takes it before its read)."""
    ledger = Ledger(pg_engine)
    first_customer, second_customer = customer_with(ledger, 10 * HOLD), customer_with(ledger, 10 * HOLD)
    with pg_engine.begin() as conn:
        spend_limits.create_limit(conn, 7, 5 * HOLD)
    first = pg_engine.connect()
    transaction = first.begin()
    try:
        [theirs] = place_holds(first, [PlaceHold(first_customer, 4 * HOLD, key("hold"), spend_limit_id=7)])
        mine = _placed_once_waiting_for(pg_engine, transaction, PlaceHold(second_customer, 3 * HOLD, key("hold"), spend_limit_id=7))
    finally:
        first.close()
    assert theirs.amount_nano_usd == 4 * HOLD
    assert isinstance(mine, SpendLimitReached), mine
    with pg_engine.connect() as conn:
        assert spend_limits.read_limits(conn, [7])[7]["held_nano_usd"] == 4 * HOLD
    assert ledger.balance(second_customer).held_nano_usd == 0
    ledger.close()


def test_verify_while_appends_go_on_reads_one_state_and_finds_nothing_wrong(pg_engine):
    """Given a ledger being appended to without pause, when it is verified
    again and again meanwhile, then every verify is clean: the log, the head
    and the balances are read from one snapshot, not each at its own moment."""
    ledger = Ledger(pg_engine)
    account = customer_with(ledger, 1)
    ledger.close()
    stop = threading.Event()

    with ThreadPoolExecutor(max_workers=2) as pool:
        writers = [pool.submit(keep_granting, pg_engine, account, stop) for _ in range(2)]
        try:
            reports = []
            for _ in range(30):
                with snapshot_connection(pg_engine) as conn:
                    reports.append(verify(conn))
        finally:
            stop.set()
        appended = sum(writer.result() for writer in writers)
    assert appended > 0, "appends went on while verifying"
    assert [r.problems for r in reports if not r.ok] == []


def test_the_postings_layout_flips_while_two_writers_append_and_every_event_keeps_its_legs(pg_engine):
    """Two writers append while the owner turns postings-in-event-row on and off
    again and again. The flag is read under the append lock, so every event after
    a flip is written the new way, even by a batch drafted the old way before the
    lock; each event keeps its legs in exactly one place, and verify passes."""
    ledger = Ledger(pg_engine)
    account = customer_with(ledger, 0)
    ledger.close()
    with pg_engine.connect() as conn:
        flips = [(0, conn.execute(text("SELECT postings_in_event_row FROM ledger_head")).scalar_one())]
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=2) as pool:
        writers = [pool.submit(keep_granting, pg_engine, account, stop) for _ in range(2)]
        try:
            for flip in range(20):
                with pg_engine.begin() as conn:
                    set_postings_in_event_row(conn, flip % 2 == 0)
                    flips.append((conn.execute(text("SELECT last_seq FROM ledger_head")).scalar_one(), flip % 2 == 0))
                wait_for(lambda: _last_seq(pg_engine) > flips[-1][0], timeout_s=30, interval_s=0.005)  # written this way
        finally:
            stop.set()
        appended = sum(writer.result() for writer in writers)
    with pg_engine.connect() as conn:
        layouts = conn.execute(text(
            "SELECT e.seq, e.posting_account_ids IS NOT NULL, count(p.event_seq) FROM ledger_events e "
            "LEFT JOIN ledger_postings p ON p.event_seq = e.seq GROUP BY e.seq ORDER BY e.seq")).all()
    assert appended == len(layouts) > 20
    for seq, in_row, posting_rows in layouts:
        expected = [on for flipped_at, on in flips if flipped_at < seq][-1]
        assert (in_row, posting_rows) == ((True, 0) if expected else (False, 2)), (seq, flips)
    assert {in_row for _, in_row, _ in layouts} == {True, False}, "both layouts were written"
    with snapshot_connection(pg_engine) as conn:
        report = verify(conn)
    assert report.ok, report.problems
    assert money_snapshot(pg_engine)["balances"][account] == appended


def _last_seq(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT last_seq FROM ledger_head")).scalar_one()


def test_a_release_racing_captures_that_are_not_final_frees_exactly_what_they_left(pg_engine):
    """A pooled hold released while a batch's captures from it wait for their
    commit: the release waits for the row, then frees what the captures left,
    never what they took. Released first, the captures find no hold and move nothing."""
    ledger = Ledger(pg_engine)
    customer = customer_with(ledger, 10 * HOLD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    pool = ledger.place_hold(PlaceHold(customer, 4 * HOLD, key("pool")))
    capturing = pg_engine.connect()
    transaction = capturing.begin()
    captures = [cmd.SettleRequest(pool.hold_id, owner, HOLD // 4, key("r"), key(), {}, False) for _ in range(2)]
    assert all(r.status == "created" for r in append_batch(capturing, captures))
    with ThreadPoolExecutor(1) as pool_thread:
        released = pool_thread.submit(ledger.release_hold, pool.hold_id)
        wait_until_a_session_waits_for_a_lock(pg_engine)
        transaction.commit()
        capturing.close()
        assert released.result(timeout=30)
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd, view.available_nano_usd) == (10 * HOLD - HOLD // 2, 0, 10 * HOLD - HOLD // 2)

    second = ledger.place_hold(PlaceHold(customer, 2 * HOLD, key("pool")))
    assert ledger.release_hold(second.hold_id)
    before = money_snapshot(pg_engine)
    with pg_engine.begin() as conn:
        [late] = append_batch(conn, [cmd.SettleRequest(second.hold_id, owner, HOLD // 4, key("r"), key(), {}, False)])
    assert late.code == "hold_not_active" and money_snapshot(pg_engine) == before
    ledger.close()
