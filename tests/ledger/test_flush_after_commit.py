"""The durable writer frees the append lock before its batch's WAL flush, and
its callers are answered only after it: what a caller was told survives a crash.

The batch commits without waiting (`synchronous_commit = off`, so the lock,
a row lock, is released at once) and goes to the writer's flush waiter: there
a transaction of its own that writes WAL waits for the flush, which takes
every commit before it along, while the writer runs its next batch."""
from __future__ import annotations

import queue
import random
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import func, select, text

from app.anchoring.service import AnchorSettings, read_anchors, write_anchor
from app.migrate import migrate
from ledger import commands as cmd
from ledger.commands import CREATED, EXISTS
from ledger.db import make_engine, storage_of
from ledger.errors import DatabaseUnavailable, FlushNotConfirmed
from ledger.flush_waiter import Committed, FlushWaiter
from ledger.anchors import check_anchors
from ledger.holds import PlaceHold
from ledger.limits import DATABASE_RETRY_WAITS_S
from ledger.money import split_charge
from ledger.schema import holds, ledger_events
from ledger.service import Ledger
from ledger.store import append_one
from ledger.storage import postgres as pg_storage
from ledger.verify import verify
from tests.ledger.helpers import customer_with, key, money_snapshot
from tests.support.harness import wait_for
from tests.support.private_postgres import PrivatePostgres, server_binaries
from tests.support.services import REQUIRE_SERVICES

CREDITS_NANO_USD = 10_000_000
HOLD_NANO_USD = 100_000
CHARGE_NANO_USD = 61_237
SETTLEMENTS = 40


@pytest.fixture
def private_postgres():
    if server_binaries() is None:
        if REQUIRE_SERVICES:
            pytest.fail("no PostgreSQL server binaries (initdb, postgres) to run a private server")
        pytest.skip("no PostgreSQL server binaries (initdb, postgres) to run a private server")
    # Not under pytest's tmp_path: the server's user must be able to reach it.
    server = PrivatePostgres(Path(tempfile.mkdtemp(prefix="paralon-private-pg-")))
    try:
        yield server.create()
    finally:
        server.stop()


def _settle_all(ledger: Ledger, customer: int, owner: int) -> list:
    placed = [ledger.place_hold(PlaceHold(customer, HOLD_NANO_USD, key("hold"))) for _ in range(SETTLEMENTS)]
    futures = [ledger.appender.submit(cmd.SettleRequest(h.hold_id, owner, CHARGE_NANO_USD, key("req"), key("settle")))
               for h in placed]
    return [f.result(timeout=30) for f in futures]


@pytest.mark.parametrize("database_synchronous_commit", ["on", "off"])
def test_every_settlement_a_caller_was_told_of_survives_a_crash_of_the_database(private_postgres, database_synchronous_commit):
    """Also where the database's own setting turned synchronous_commit off:
    the writer's wait for the flush does not depend on it."""
    with psycopg.connect(private_postgres.url, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE postgres SET synchronous_commit = {database_synchronous_commit}")
    engine = make_engine(private_postgres.url)
    migrate(engine)
    ledger = Ledger(engine)
    customer = customer_with(ledger, CREDITS_NANO_USD)
    owner = ledger.create_account(cmd.OWNER, "owner")
    told = _settle_all(ledger, customer, owner)
    private_postgres.crash()  # the moment the last caller heard: the postmaster and every backend, SIGKILL
    engine.dispose()
    private_postgres.start()  # recovery replays what was flushed, nothing else
    ledger.close()
    engine = make_engine(private_postgres.url)
    try:
        with engine.connect() as conn:
            kept = set(conn.execute(select(ledger_events.c.seq)).scalars())
            assert {r.seq for r in told} <= kept, "a settlement its caller was told of was lost in the crash"
            assert verify(conn).ok
        view = Ledger(engine, flush_after_commit=False).balance(customer)
        assert view.balance_nano_usd == CREDITS_NANO_USD - SETTLEMENTS * CHARGE_NANO_USD
        assert view.held_nano_usd == 0
    finally:
        engine.dispose()


@pytest.fixture
def pg_ledger(postgres_url):
    engine = make_engine(postgres_url)
    ledger = Ledger(engine)
    yield ledger
    ledger.close()
    engine.dispose()


# The flush barrier, as the server runs it after the batch's COMMIT, made to
# fail there: the first time only, or every time, by losing its connection
# (the backend terminates itself) or by a refusal.
_CUT_THE_FIRST = ("SELECT pg_terminate_backend(pg_backend_pid()) FROM (SELECT nextval('flush_barriers_run')) AS n(v) WHERE v = 1;\n"
                  + pg_storage._FLUSH_BARRIER)
_CUT_EACH_TIME = "SELECT nextval('flush_barriers_run'), pg_terminate_backend(pg_backend_pid())"
_REFUSED = "SELECT nextval('flush_barriers_run'), 1 / 0"


def _barriers_run(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT last_value FROM flush_barriers_run")).scalar_one()


@pytest.fixture
def counted_barriers(pg_ledger):
    with pg_ledger.engine.begin() as conn:
        conn.execute(text("CREATE SEQUENCE flush_barriers_run"))


def test_a_batch_whose_flush_wait_loses_its_connection_is_answered_once(pg_ledger, counted_barriers, monkeypatch):
    """The batch committed; the wait for its flush loses its connection. The
    batch goes back to the writer, which runs it again: its key finds the
    committed settlement, nothing is charged twice, and the caller is
    answered only after a wait for the flush succeeded."""
    ledger = pg_ledger
    customer = customer_with(ledger, CREDITS_NANO_USD)
    owner = ledger.create_account(cmd.OWNER, "owner")
    hold = ledger.place_hold(PlaceHold(customer, HOLD_NANO_USD, key("hold")))
    before = money_snapshot(ledger.engine)
    monkeypatch.setattr(pg_storage, "_FLUSH_BARRIER", _CUT_THE_FIRST)
    request_key = key("settle")
    result = ledger.append(cmd.SettleRequest(hold.hold_id, owner, CHARGE_NANO_USD, key("req"), request_key))
    monkeypatch.undo()

    assert result.status == EXISTS, "the second run found what the first committed"
    assert _barriers_run(ledger.engine) == 2, "answered after a second wait, the first having lost its connection"
    after = money_snapshot(ledger.engine)
    owner_share, platform_share = split_charge(CHARGE_NANO_USD)
    moved = {a: after["balances"][a] - before["balances"].get(a, 0) for a in after["balances"]}
    assert after["events"] == before["events"] + 1
    assert moved[customer] == -CHARGE_NANO_USD and moved[owner] == owner_share
    assert sorted(m for m in moved.values() if m) == sorted([-CHARGE_NANO_USD, owner_share, platform_share]), "the platform's share, once"
    with ledger.engine.connect() as conn:
        assert conn.execute(select(ledger_events.c.seq).where(ledger_events.c.idempotency_key == request_key)).scalar_one() == result.seq
        assert conn.execute(select(func.count()).select_from(holds)).scalar_one() == 0
        assert verify(conn).ok


@contextmanager
def _flushes_held(postgres_url, monkeypatch, barrier: str = pg_storage._FLUSH_BARRIER):
    """Every flush barrier (`barrier`) waits, before it runs, for an advisory
    lock the test holds until it calls the `release` yielded (or the block ends)."""
    lock_key = random.getrandbits(31)
    with psycopg.connect(postgres_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", [lock_key])
        monkeypatch.setattr(pg_storage, "_FLUSH_BARRIER", f"SELECT pg_advisory_lock({lock_key});\n"
                            f"SELECT pg_advisory_unlock({lock_key});\n{barrier}")
        yield lambda: holder.execute("SELECT pg_advisory_unlock(%s)", [lock_key])


class _SecondBatchFails(Exception):
    """A bug in the second batch, made for the test: it fails as a whole, and is answered at once."""


@contextmanager
def _second_queued_behind_the_first(writer, monkeypatch, first, second, *, second_fails: bool = False):
    """`first` submitted, its batch held before its statements until `second`
    is queued behind it: the first batch, finding a batch behind it, goes to
    the flush waiter. Yields both futures once the first committed and the
    second committed (or, `second_fails`, failed as a whole)."""
    entered, go = threading.Event(), threading.Event()
    apply = writer._apply_batch

    def held_once(conn, commands):
        if not entered.is_set():
            entered.set()
            go.wait(30)
        if second_fails and second in commands:
            raise _SecondBatchFails()
        return apply(conn, commands)

    monkeypatch.setattr(writer, "_apply_batch", held_once)
    answers = [writer.submit(first)]
    assert entered.wait(30)
    answers.append(writer.submit(second))
    go.set()
    wait_for(lambda: _committed(writer._engine, first.idempotency_key), timeout_s=30)
    if second_fails:
        wait_for(answers[1].done, timeout_s=30)
    else:
        wait_for(lambda: _committed(writer._engine, second.idempotency_key), timeout_s=30)
    yield answers


def _committed(engine, idempotency_key: str) -> bool:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(ledger_events)
                            .where(ledger_events.c.idempotency_key == idempotency_key)).scalar_one() == 1


def test_the_writer_commits_its_next_batch_while_the_last_ones_flush_is_awaited_and_answers_neither_before_it(
        pg_ledger, postgres_url, monkeypatch):
    """The writer does not wait for a batch's flush when another is queued
    behind it; no caller hears of a commit before a flush barrier vouched for it."""
    ledger = pg_ledger
    customer = customer_with(ledger, CREDITS_NANO_USD)
    before = money_snapshot(ledger.engine)
    first, second = (cmd.GrantCredits(customer, amount, "granted during a slow flush", key("grant")) for amount in (1, 2))
    with (_flushes_held(postgres_url, monkeypatch) as release,
          _second_queued_behind_the_first(ledger.appender, monkeypatch, first, second) as answers):
        assert not any(answer.done() for answer in answers), "a caller heard of a commit not known to be flushed"
        release()
        assert [answer.result(timeout=30).status for answer in answers] == [CREATED, CREATED]
    after = money_snapshot(ledger.engine)
    assert after["events"] == before["events"] + 2
    assert after["balances"][customer] == before["balances"][customer] + 3


def test_closing_the_writer_waits_for_the_flush_awaited_and_answers_its_callers(pg_ledger, postgres_url, counted_barriers,
                                                                                  monkeypatch):
    """A batch waits for its flush on the flush waiter, whose barrier then
    loses its connection: the writer, closing, runs it again, and its caller
    hears what the second run found before close returns."""
    ledger = pg_ledger
    customer = customer_with(ledger, CREDITS_NANO_USD)
    before = money_snapshot(ledger.engine)
    first, second = (cmd.GrantCredits(customer, amount, "granted as the writer closes", key("grant")) for amount in (7, 8))
    with (_flushes_held(postgres_url, monkeypatch, _CUT_THE_FIRST) as release,
          _second_queued_behind_the_first(ledger.appender, monkeypatch, first, second, second_fails=True) as answers):
        with pytest.raises(_SecondBatchFails):
            answers[1].result(timeout=0)
        closing = threading.Thread(target=ledger.close)
        closing.start()
        closing.join(0.2)
        assert closing.is_alive() and not answers[0].done(), "closed before the flush it awaited was known"
        release()
        closing.join(30)
    assert not closing.is_alive()
    assert answers[0].result(timeout=0).status == EXISTS, "answered by its second run, its first barrier having lost its connection"
    assert _barriers_run(ledger.engine) == 2
    after = money_snapshot(ledger.engine)
    assert after["events"] == before["events"] + 1
    assert after["balances"][customer] == before["balances"][customer] + 7


def test_a_barrier_vouches_only_for_commits_made_after_its_connection_was_opened(postgres_url):
    """A restart of the server between a commit and a connection opened after
    it could lose the commit while a barrier there succeeds: the waiter never
    opens its own connection, and sends back what was committed before the one
    it has (`lost`, to run again), answering only the rest (`flushed`)."""
    engine = make_engine(postgres_url)
    answers: queue.Queue = queue.Queue()
    waiter = FlushWaiter(engine, name="flush-waiter-test", flushed=lambda items: answers.put(("flushed", items)),
                         lost=lambda items, exc: answers.put(("lost", items)),
                         refused=lambda items, exc: answers.put(("refused", items)))
    try:
        def answer_to(committed: Committed) -> str:
            waiter.hand(committed)
            kind, items = answers.get(timeout=30)
            assert items == [committed]
            return kind

        before_any = Committed([], ["committed before any connection"], 0, epoch=0)
        assert answer_to(before_any) == "lost"
        assert engine.pool.checkedout() == 0, "the waiter opened no connection of its own"
        first = waiter.epoch_before_commit()
        assert waiter.epoch_before_commit() == first, "the same connection while it is not lost"
        assert answer_to(Committed([], ["after the first"], 0, first)) == "flushed"
        renewed = waiter.epoch_before_commit(renew=True)
        assert renewed != first
        assert answer_to(Committed([], ["before the renewal"], 0, first)) == "lost"
        assert answer_to(Committed([], ["after the renewal"], 0, renewed)) == "flushed"
    finally:
        waiter.stop()
        waiter.join(30)
        assert engine.pool.checkedout() == 0, "its connections went back to the pool"
        engine.dispose()


@pytest.mark.parametrize("barrier", [_CUT_EACH_TIME, _REFUSED], ids=["connection-lost-each-time", "refused"])
def test_a_flush_wait_that_keeps_failing_announces_nothing_and_a_retry_finds_it_once(pg_ledger, counted_barriers, monkeypatch,
                                                                                      barrier):
    """While no wait for the flush succeeds, the caller hears `DatabaseUnavailable`,
    never a result nor a failure of its own: a grant not known to be flushed
    is not announced. Its commit stands; the retry with the same key finds it, once."""
    ledger = pg_ledger
    customer = customer_with(ledger, CREDITS_NANO_USD)
    before = money_snapshot(ledger.engine)
    grant = cmd.GrantCredits(customer, 5, "announced late", key("grant"))
    monkeypatch.setattr(pg_storage, "_FLUSH_BARRIER", barrier)
    with pytest.raises(DatabaseUnavailable) as refused:
        ledger.append(grant)
    monkeypatch.undo()
    if barrier == _REFUSED:  # answered at once: run again, the barrier would be refused again
        assert isinstance(refused.value, FlushNotConfirmed) and _barriers_run(ledger.engine) == 1
    else:  # each loss runs the batch again, as often as a lost connection is retried, then no more
        assert not isinstance(refused.value, FlushNotConfirmed)
        assert _barriers_run(ledger.engine) == len(DATABASE_RETRY_WAITS_S) + 1
    retried = ledger.append(grant)
    after = money_snapshot(ledger.engine)
    assert retried.status == EXISTS
    assert after["events"] == before["events"] + 1
    assert after["balances"][customer] == before["balances"][customer] + 5


def test_a_head_committed_but_not_flushed_is_flushed_before_it_is_anchored(private_postgres, tmp_path):
    """A writer commits, then waits for the flush: an anchor taken in between
    must not publish a head a crash then takes back."""
    engine = make_engine(private_postgres.url)
    migrate(engine)
    ledger = Ledger(engine)
    customer = customer_with(ledger, CREDITS_NANO_USD)
    ledger.close()
    with engine.begin() as conn:  # what the writer does before its wait for the flush
        storage_of(conn).skip_flush_wait(conn)
        appended = append_one(conn, cmd.GrantCredits(customer, 1, "committed, not flushed", key("grant")))
    settings = AnchorSettings(tmp_path / "anchors.jsonl")
    anchored = write_anchor(engine, settings)
    assert anchored["seq"] == appended.seq
    private_postgres.crash()
    engine.dispose()
    private_postgres.start()
    engine = make_engine(private_postgres.url)
    try:
        with engine.connect() as conn:
            assert check_anchors(conn, read_anchors(settings).anchors) == []
    finally:
        engine.dispose()
