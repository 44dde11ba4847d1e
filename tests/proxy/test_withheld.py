"""A withheld answer whose settlement committed anyway (its acknowledgement
was lost with the database) is reversed, even when the process stops before
the database is back; shutdown waits for the database a bounded time."""
from __future__ import annotations

import asyncio

import pytest

from ledger.errors import DatabaseUnavailable
from ledger.holds import settlement_key
from ledger.verify import verify
from proxy import settlement
from proxy.generations import generation_record
from proxy.limits import HOLD_TTL_S_DEFAULT, SHUTDOWN_DATABASE_WAIT_S
from proxy.settlement import Settler
from proxy.upstream import UpstreamPool
from proxy.withheld import WithheldJournal
from tests.proxy.test_settlement import CREDITS_NANO_USD, Books, relay

GUARD_S = SHUTDOWN_DATABASE_WAIT_S + 60  # only so a hang fails instead of blocking the run


@pytest.fixture
def books(tmp_path):
    books = Books(tmp_path / "withheld.db")
    yield books
    books.close()


def ack_lost_then_away(books: Books):
    """The first append commits and its acknowledgement is lost; every later one finds the database away."""
    real = books.ledger.append_async
    calls = []

    async def append(command):
        calls.append(command)
        if len(calls) == 1:
            await real(command)
        raise DatabaseUnavailable("the connection dropped")
    return append


def assert_untouched(books: Books) -> None:
    assert books.balance(books.customer).balance_nano_usd == CREDITS_NANO_USD
    assert books.balance(books.customer).available_nano_usd == CREDITS_NANO_USD
    assert books.balance(books.owner).balance_nano_usd == 0
    with books.engine.connect() as conn:
        assert verify(conn).ok


def test_a_withheld_charge_is_reversed_after_a_restart(books, tmp_path, monkeypatch):
    journal_path = tmp_path / "withheld" / "replica-1.jsonl"
    books.settler.journal = WithheldJournal(journal_path)
    generation = books.open(streaming=False)
    relay(generation, 10, usage=(12, 10))
    monkeypatch.setattr(books.ledger, "append_async", ack_lost_then_away(books))

    async def until_shutdown() -> None:
        await generation.settle_once(charge=True)
        assert generation.settle_failed and generation.cost_nano_usd == 0  # the caller gets its 503
        await asyncio.wait_for(books.settler.drain_background(), GUARD_S)  # stops before the database is back

    asyncio.run(until_shutdown())
    assert settlement_key(generation.request_id) in books.settlements()  # it did commit
    assert WithheldJournal(journal_path).pending() == [generation.request_id]

    monkeypatch.undo()  # the database is back; a new process starts with the same journal
    restarted = Settler(books.ledger, books.directory, UpstreamPool(), hold_ttl_s=HOLD_TTL_S_DEFAULT,
                        journal=WithheldJournal(journal_path))

    async def after_restart() -> None:
        assert restarted.resume_withheld() == 1
        await asyncio.wait_for(restarted.drain_background(), GUARD_S)

    asyncio.run(after_restart())
    assert_untouched(books)
    assert WithheldJournal(journal_path).pending() == []
    assert journal_path.read_bytes() == b""  # compacted once nothing is owed
    with books.engine.connect() as conn:
        shown = generation_record(conn, generation.request_id)
    assert shown["reversed"] is True and shown["cost_nano_usd"] == 0 and shown["owner_nano_usd"] == 0


def test_a_withheld_answer_that_never_committed_leaves_nothing_owed(books, tmp_path, monkeypatch):
    journal = books.settler.journal = WithheldJournal(tmp_path / "replica-1.jsonl")
    generation = books.open(streaming=False)
    relay(generation, 10, usage=(12, 10))

    async def away(command):
        raise DatabaseUnavailable("the database is away")

    monkeypatch.setattr(books.ledger, "append_async", away)

    async def run() -> None:
        await generation.settle_once(charge=True)
        assert journal.pending() == [generation.request_id]
        await books.settler.drain_background()

    monkeypatch.setattr(settlement, "SHUTDOWN_DATABASE_WAIT_S", 0.0)
    asyncio.run(run())
    monkeypatch.undo()
    restarted = Settler(books.ledger, books.directory, UpstreamPool(), hold_ttl_s=HOLD_TTL_S_DEFAULT, journal=journal)

    async def after_restart() -> None:
        restarted.resume_withheld()
        await asyncio.wait_for(restarted.drain_background(), GUARD_S)

    asyncio.run(after_restart())
    assert journal.pending() == []
    books.sweep()
    assert books.settlements() == {}
    assert_untouched(books)


def test_shutdown_stops_waiting_for_the_database_within_its_bound(books, monkeypatch):
    """A settlement that fails during the drain starts its wait after the drain began: the one deadline still holds."""
    generation = books.open()
    relay(generation, 10, usage=(12, 10))
    started = asyncio.Event()

    async def slowly_away(command):
        started.set()
        await asyncio.sleep(0)
        raise DatabaseUnavailable("the database is away")

    monkeypatch.setattr(books.ledger, "append_async", slowly_away)

    async def run() -> None:
        books.settler.settle(generation, True)  # in flight as shutdown begins
        await asyncio.wait_for(books.settler.drain_background(), GUARD_S)

    asyncio.run(run())
    assert books.settlements() == {}
    books.sweep()  # the hold keeps what was delivered; the sweeper charges it
    charge = 12 * 150 + 10 * 600
    assert books.balance(books.customer).balance_nano_usd == CREDITS_NANO_USD - charge
