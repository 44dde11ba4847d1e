"""The Settler with pooled holds, without servers (as test_settlement.py):
a request's share of its replica's pooled hold is captured (not finally),
given back, or moved to a hold of its own, and never two of these at once."""
from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from ledger.errors import DatabaseUnavailable, FlushNotConfirmed, InvariantBroken
from ledger.hold_pool import HoldPool
from ledger.schema import holds
from proxy import metering
from proxy.generation import CHAT, Generation
from proxy.keys import KeyGrant
from proxy.settlement import Settler, hold_key
from proxy.upstream import UpstreamPool
from ledger.schema import utc_now
from proxy.limits import HOLD_TTL_S_DEFAULT
from tests.proxy.test_settlement import MAX_TOKENS, PRICE, PROMPT_BOUND, Books, relay

POOL_REQUESTS = 4


class PooledBooks(Books):
    def __init__(self, database_path) -> None:
        super().__init__(database_path)
        self.pool = HoldPool(self.ledger, ttl_s=HOLD_TTL_S_DEFAULT, pool_requests=POOL_REQUESTS)
        self.settler = Settler(self.ledger, self.directory, UpstreamPool(), hold_ttl_s=HOLD_TTL_S_DEFAULT, pool=self.pool)

    async def open_pooled(self, *, streaming: bool = True) -> Generation:
        """A request reserved from the pool, as the proxy leaves it with PARALON_HOLD_POOLS=1."""
        self.requests += 1
        generation = Generation(
            kind=CHAT, request_id=f"chatcmpl-{self.requests}", model="m", price=PRICE,
            grant=KeyGrant(1, self.customer, None), prompt_bound=PROMPT_BOUND, max_tokens=MAX_TOKENS,
            wants_usage=True, wants_continuous_usage=False, started_at=utc_now(), streaming=streaming,
            settle=self.settler.settle)
        plan = metering.plan_hold(PRICE, PROMPT_BOUND, MAX_TOKENS)
        reservation = await self.pool.reserve(self.customer, plan.amount_nano_usd)
        generation.accept_hold(reservation.hold_id, reservation.amount_nano_usd)
        generation.reservation = reservation
        self.settler.track(generation)
        generation.use_worker(self.worker, {"messages": []})
        self.load.in_flight += 1
        return generation

    def hold_amounts(self) -> dict[int, int]:
        with self.engine.connect() as conn:
            return dict(conn.execute(select(holds.c.id, holds.c.amount_nano_usd)).all())


@pytest.fixture
def books(tmp_path):
    books = PooledBooks(tmp_path / "pooled.db")
    yield books
    books.close()


def _held(books) -> int:
    return books.balance(books.customer).held_nano_usd


def test_a_pooled_request_is_captured_not_finally_and_a_released_one_writes_nothing(books):
    async def run() -> tuple[Generation, int, dict]:
        charged, released = await books.open_pooled(), await books.open_pooled()
        pool_hold = charged.hold_id
        relay(charged, 10, usage=(12, 10))
        await charged.settle_once(charge=True)
        after_capture = books.hold_amounts()
        await released.settle_once(charge=False)
        await books.settler.drain_background()
        return charged, pool_hold, after_capture

    charged, pool_hold, after_capture = asyncio.run(run())
    plan = metering.plan_hold(PRICE, PROMPT_BOUND, MAX_TOKENS)
    charge = 12 * 150 + 10 * 600
    [settled] = books.settlements().values()
    assert (settled["hold_id"], settled["charge_nano_usd"], settled["released_nano_usd"]) == (pool_hold, charge, 0)
    assert after_capture == {pool_hold: POOL_REQUESTS * plan.amount_nano_usd - charge}
    assert books.hold_amounts() == {}, "released at shutdown, the give-back written nowhere before it"
    view = books.balance(books.customer)
    assert (view.held_nano_usd, view.balance_nano_usd) == (0, 10**9 - charge)


def _settled_once_on_its_own_hold(books, generation: Generation) -> None:
    """Charged once, finally, on the hold it moved to; the pool lost its amount once (nothing is left held)."""
    plan, charge = metering.plan_hold(PRICE, PROMPT_BOUND, MAX_TOKENS), 12 * 150 + 10 * 600
    [settled] = books.settlements().values()
    assert settled["hold_id"] == generation.hold_id and settled["released_nano_usd"] == plan.amount_nano_usd - charge
    view = books.balance(books.customer)
    assert (view.held_nano_usd, view.balance_nano_usd) == (0, 10**9 - charge)


def test_a_settlement_waits_for_a_move_to_its_own_hold_on_its_way_and_settles_that_hold_finally(books):
    """The move and the capture would each take the request's amount from the
    pool's hold; one at a time, the pool loses the amount once."""
    real_split, go = books.pool.split_many, None

    async def held_back_split(moves):
        await go.wait()
        return await real_split(moves)

    async def run() -> Generation:
        nonlocal go
        go = asyncio.Event()
        books.pool.split_many = held_back_split
        generation = await books.open_pooled()
        relay(generation, 10, usage=(12, 10))
        moving = asyncio.ensure_future(books.settler._split(generation))
        await asyncio.sleep(0)  # the move holds the request's hold lock, waiting to go
        settling = asyncio.ensure_future(generation.settle_once(charge=True))
        await asyncio.sleep(0.05)
        assert not settling.done(), "the settlement waits for the move"
        go.set()
        await moving
        await settling
        await books.settler.drain_background()
        return generation

    _settled_once_on_its_own_hold(books, asyncio.run(run()))


def test_a_move_whose_outcome_is_unknown_is_done_again_by_its_key_before_the_settlement(books):
    real_split = books.ledger.split_holds

    def split_then_lose_the_answer(splits):
        real_split(splits)  # committed, then the connection drops before the answer
        books.ledger.split_holds = real_split
        raise OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))

    async def run() -> Generation:
        books.ledger.split_holds = split_then_lose_the_answer
        generation = await books.open_pooled()
        relay(generation, 10, usage=(12, 10))
        with pytest.raises(OperationalError):
            await books.settler._split(generation)
        assert generation.split_pending and generation.reservation is not None
        await generation.settle_once(charge=True)
        await books.settler.drain_background()
        return generation

    _settled_once_on_its_own_hold(books, asyncio.run(run()))


def test_a_released_request_whose_move_cannot_be_confirmed_is_forgotten_not_given_back(books):
    def database_away(splits):
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    async def run() -> tuple[int, int]:
        generation = await books.open_pooled()
        pool = generation.reservation.pool
        free_before_release = pool.free_nano_usd
        books.ledger.split_holds = database_away
        with pytest.raises(OperationalError):
            await books.settler._split(generation)
        await generation.settle_once(charge=False)
        return free_before_release, pool.free_nano_usd, pool.in_flight

    free_before, free_after, in_flight = asyncio.run(run())
    assert (free_after, in_flight) == (free_before, 0), "never counted free again: it may have left the pool"


def _commit_then_lose_the_answer(books) -> None:
    """The next append commits, then its answer is lost ("committed, perhaps")."""
    real_append = books.ledger.append_async

    async def lost(command):
        await real_append(command)
        books.ledger.append_async = real_append
        raise FlushNotConfirmed()

    books.ledger.append_async = lost


def test_a_pooled_capture_whose_answer_is_lost_is_never_counted_free_again(books):
    """A non-streaming caller gets no answer and its settlement is reversed;
    what the capture took from the pool's hold is not reserved again, so
    every later request of the pool's whole amount is captured from it."""
    charge = 12 * 150 + 10 * 600

    async def run() -> tuple[int, int, list[Generation], int]:
        lost = await books.open_pooled(streaming=False)
        pool = lost.reservation.pool
        free_before = pool.free_nano_usd
        _commit_then_lose_the_answer(books)
        relay(lost, 10, usage=(12, 10))
        await lost.settle_once(charge=True)
        free_after = pool.free_nano_usd
        later = [await books.open_pooled(streaming=False) for _ in range(POOL_REQUESTS)]  # all the pool counts free, and more
        for generation in later:
            relay(generation, 10, usage=(12, 10))
            await generation.settle_once(charge=True)
        await books.settler.drain_background()
        return free_before, free_after, later, pool.hold_id

    free_before, free_after, later, pool_hold = asyncio.run(run())
    assert free_after == free_before, "its reservation may have been captured: never free again"
    settled = books.settlements()
    assert all(settled[f"settle:{g.request_id}"]["charge_nano_usd"] == charge for g in later), "every later request paid"
    assert sum(s["hold_id"] == pool_hold for s in settled.values()) == POOL_REQUESTS, "the lost one and the first three of the pool's"
    view = books.balance(books.customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (10**9 - POOL_REQUESTS * charge, 0), \
        "the withheld answer's charge reversed, each later one paid once, nothing left held"


def test_a_streams_pooled_capture_whose_answer_is_lost_is_sent_again_not_moved(books):
    """Moved to a hold of its own, the stream would take its amount from the
    pool's hold after its capture took its charge: it is sent again by its
    key instead, found, and charged once."""
    charge = 12 * 150 + 10 * 600

    async def run() -> Generation:
        stream = await books.open_pooled()
        _commit_then_lose_the_answer(books)
        relay(stream, 10, usage=(12, 10))
        await stream.settle_once(charge=True)
        await books.settler.drain_background()
        return stream

    stream = asyncio.run(run())
    [settled] = books.settlements().values()
    assert settled["charge_nano_usd"] == charge and stream.reservation is None
    with books.engine.connect() as conn:
        own = conn.execute(select(holds.c.id).where(holds.c.idempotency_key == hold_key(stream.request_id))).all()
    assert own == [], "no hold of its own"
    view = books.balance(books.customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (10**9 - charge, 0)


def test_a_stream_whose_pending_move_finds_its_pool_gone_is_charged_on_a_hold_of_its_own(books):
    """Its move's outcome was not known, and the pool's hold was swept since:
    nothing of it was captured, so the whole charge is placed and captured anew."""
    charge = 12 * 150 + 10 * 600

    def database_away(splits):
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    async def run() -> Generation:
        stream = await books.open_pooled()
        relay(stream, 10, usage=(12, 10))
        real_split, books.ledger.split_holds = books.ledger.split_holds, database_away
        with pytest.raises(OperationalError):
            await books.settler._split(stream)
        books.ledger.split_holds = real_split
        books.sweep()  # the pool's hold expired, untouched: released
        await stream.settle_once(charge=True)
        await books.settler.drain_background()
        return stream

    stream = asyncio.run(run())
    [settled] = books.settlements().values()
    assert settled["charge_nano_usd"] == charge, "charged, not given away"
    view = books.balance(books.customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (10**9 - charge, 0)


def test_a_streams_share_is_forgotten_when_its_tries_end_so_its_pool_is_released(books):
    """Its move never confirmed, the database away until shutdown: the tries
    end, and the pool no longer counts it in flight (kept, the pool's hold
    would be renewed and held for as long as the replica runs)."""

    def database_away(splits):
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    async def run() -> tuple[int, dict]:
        stream = await books.open_pooled()
        pool = stream.reservation.pool
        relay(stream, 10, usage=(12, 10))
        books.ledger.split_holds = database_away
        with pytest.raises(OperationalError):
            await books.settler._split(stream)
        await stream.settle_once(charge=True)
        await books.settler.drain_background()
        return pool.in_flight, books.hold_amounts()

    in_flight, left = asyncio.run(run())
    assert (in_flight, left) == (0, {}), "nothing in flight, the pool released at shutdown"


def test_a_streams_capture_never_made_is_recorded_on_a_hold_of_its_own_when_its_tries_end(books):
    """Its capture's answer lost without committing, then its retry refused
    for another reason: looked up, it was never made, so the stream records
    what it delivered on a hold of its own, which the sweeper settles."""
    charge = 12 * 150 + 10 * 600
    real_append, failures = books.ledger.append_async, [DatabaseUnavailable("the database is unavailable"), InvariantBroken("refused")]

    async def failing(command):
        if failures:
            raise failures.pop(0)
        return await real_append(command)

    async def run() -> Generation:
        stream = await books.open_pooled()
        books.ledger.append_async = failing
        relay(stream, 10, usage=(12, 10))
        await stream.settle_once(charge=True)
        await books.settler.drain_background()
        return stream

    stream = asyncio.run(run())
    assert books.settlements() == {} and stream.reservation is None
    books.sweep()
    [settled] = books.settlements().values()
    assert settled["charge_nano_usd"] == charge, "charged once, by the sweeper, at what the stream delivered"
    view = books.balance(books.customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (10**9 - charge, 0)
