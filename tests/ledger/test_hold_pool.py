"""A replica's requests reserved against pooled holds (ledger.hold_pool): one
hold row serves many requests, and no request ever has more reserved for it
than its customer, its spend limit and its pool's hold allow. Shared suite:
SQLite and PostgreSQL."""
from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from ledger import commands as cmd
from ledger import spend_limits
from ledger.errors import HoldNotActive, IdempotencyConflict, InsufficientFunds, SpendLimitReached, WrongAccountKind
from ledger import hold_pool
from ledger.hold_pool import HoldPool
from ledger.holds import HoldRenewal, PlaceHold, expire_holds, settlement_key
from ledger.schema import holds, utc_now
from ledger.verify import verify
from tests.ledger.helpers import customer_with, key, money_snapshot

USD = 1_000_000_000
REQUEST_NANO_USD = 100_000_000  # what one request reserves
LIMIT_ID = 79


def _active_holds(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(holds)).scalar_one()


def _hold_amounts(engine) -> dict[int, int]:
    with engine.connect() as conn:
        return dict(conn.execute(select(holds.c.id, holds.c.amount_nano_usd)).all())


async def _request(pool: HoldPool, customer: int, owner: int, charge: int, **reserve) -> int:
    """One request: reserve, then settle at `charge`; returns the charge."""
    reservation = await pool.reserve(customer, REQUEST_NANO_USD, **reserve)
    request_id = key("req")
    await pool.settle(reservation, owner, charge, request_id, settlement_key(request_id), {"model": "m"})
    return charge


@pytest.fixture
def owner(ledger) -> int:
    return ledger.create_account(cmd.OWNER, "gpu owner")


def test_many_requests_share_one_hold_and_pay_exactly_their_charges(ledger, engine, owner):
    customer = customer_with(ledger, 100 * USD)

    async def run() -> list[int]:
        pool = HoldPool(ledger, pool_requests=8)
        charges = await asyncio.gather(*(_request(pool, customer, owner, 1_000_000 + i) for i in range(6)))
        assert pool.pools_placed == 1 and _active_holds(engine) == 1, "six requests in flight fit in one pool of eight"
        view = ledger.balance(customer)
        assert view.held_nano_usd == 8 * REQUEST_NANO_USD - sum(charges), "the pool's hold keeps what was not charged"
        await pool.close()
        return charges

    charges = asyncio.run(run())
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd, view.available_nano_usd) == (100 * USD - sum(charges), 0, 100 * USD - sum(charges))
    assert ledger.balance(owner).balance_nano_usd == sum(c * 80 // 100 for c in charges)
    assert _active_holds(engine) == 0, "closing the pool released its hold"
    with engine.connect() as conn:
        assert verify(conn).ok


def test_more_requests_in_flight_than_a_pool_holds_place_another_and_release_the_first_when_done(ledger, engine, owner):
    customer = customer_with(ledger, 100 * USD)

    async def run() -> tuple[int, list[int]]:
        pool = HoldPool(ledger, pool_requests=4)
        reservations = [await pool.reserve(customer, REQUEST_NANO_USD) for _ in range(10)]
        held = ledger.balance(customer).held_nano_usd
        charges = []
        for r in reservations:
            request_id = key("req")
            await pool.settle(r, owner, 2_000_000, request_id, settlement_key(request_id))
            charges.append(2_000_000)
        await pool.close()
        return pool.pools_placed, held, charges

    placed, held_in_flight, charges = asyncio.run(run())
    assert placed == 3 and held_in_flight == 12 * REQUEST_NANO_USD, "ten requests of four a pool: three pools"
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (100 * USD - sum(charges), 0)
    assert _active_holds(engine) == 0, "every pool released once its last request settled"


def test_a_pool_is_placed_whole_or_not_at_all_and_a_refused_one_is_not_asked_for_again_for_a_while(ledger, engine, owner, monkeypatch):
    customer = customer_with(ledger, 250_000_000)  # two and a half requests' amounts

    async def run() -> None:
        monkeypatch.setattr(hold_pool, "HOLD_POOL_RETRY_S", 1.0)
        pool = HoldPool(ledger, pool_requests=64)
        before, asked = money_snapshot(engine), ledger.holder.commands_committed
        assert await pool.reserve(customer, REQUEST_NANO_USD) is None, "64 requests' amounts are more than the customer has"
        assert money_snapshot(engine) == before and ledger.holder.commands_committed == asked + 1
        assert await pool.reserve(customer, REQUEST_NANO_USD) is None
        assert ledger.holder.commands_committed == asked + 1, "not asked again within HOLD_POOL_RETRY_S"
        await asyncio.sleep(1.0)
        assert await pool.reserve(customer, REQUEST_NANO_USD) is None
        assert ledger.holder.commands_committed == asked + 2, "asked again after it"
        small = HoldPool(ledger, pool_requests=2)
        placed = await small.reserve(customer, REQUEST_NANO_USD)
        assert placed is not None and ledger.balance(customer).held_nano_usd == 2 * REQUEST_NANO_USD, "a whole pool, not what was available"
        await small.give_back(placed)
        await small.close()

    asyncio.run(run())


def test_two_replicas_pools_never_reserve_more_than_the_customer_has(ledger, engine, owner):
    customer = customer_with(ledger, 500_000_000)

    async def run() -> None:
        one, other = HoldPool(ledger, replica_id="one", pool_requests=4), HoldPool(ledger, replica_id="other", pool_requests=4)
        pooled = await one.reserve(customer, REQUEST_NANO_USD)
        assert pooled is not None and ledger.balance(customer).available_nano_usd == REQUEST_NANO_USD
        assert await other.reserve(customer, REQUEST_NANO_USD) is None, "what is left does not cover a whole pool"
        own = ledger.place_hold(PlaceHold(customer, REQUEST_NANO_USD, key("hold")))  # the other replica's request, its own hold
        assert ledger.balance(customer).available_nano_usd == 0
        before = money_snapshot(engine)
        with pytest.raises(InsufficientFunds):
            ledger.place_hold(PlaceHold(customer, REQUEST_NANO_USD, key("hold")))
        assert money_snapshot(engine) == before
        assert ledger.release_hold(own.hold_id)
        await one.give_back(pooled)
        await one.close()

    asyncio.run(run())
    assert ledger.balance(customer).held_nano_usd == 0 and _active_holds(engine) == 0


def test_a_pool_on_a_spend_limit_is_placed_only_where_the_limit_covers_it_whole(ledger, engine, owner):
    customer = customer_with(ledger, 100 * USD)
    with engine.begin() as conn:
        spend_limits.create_limit(conn, LIMIT_ID, 300_000_000)

    async def run() -> None:
        before = money_snapshot(engine)
        assert await HoldPool(ledger).reserve(customer, REQUEST_NANO_USD, spend_limit_id=LIMIT_ID) is None, "64 amounts: over the limit"
        assert money_snapshot(engine) == before
        pool = HoldPool(ledger, pool_requests=2)
        await _request(pool, customer, owner, 80_000_000, spend_limit_id=LIMIT_ID)
        first = await pool.reserve(customer, REQUEST_NANO_USD, spend_limit_id=LIMIT_ID)  # 120 left in the pool
        assert first is not None and first.hold_id == pool._pools[(customer, LIMIT_ID)].hold_id
        before = money_snapshot(engine)
        assert await pool.reserve(customer, REQUEST_NANO_USD, spend_limit_id=LIMIT_ID) is None, \
            "20 left in the pool, 100 in the limit: no new pool of 200"
        assert money_snapshot(engine) == before
        await pool.give_back(first)
        await pool.close()

    asyncio.run(run())
    with engine.connect() as conn:
        limit = spend_limits.read_limits(conn, [LIMIT_ID])[LIMIT_ID]
    assert (limit["spent_nano_usd"], limit["held_nano_usd"]) == (80_000_000, 0)


def test_a_settlement_refused_gives_the_reservation_back(ledger, engine, owner):
    customer = customer_with(ledger, 10 * USD)
    not_an_owner = customer_with(ledger, 0)

    async def run() -> int:
        pool = HoldPool(ledger, pool_requests=2)
        reservation = await pool.reserve(customer, REQUEST_NANO_USD)
        before = money_snapshot(engine)
        with pytest.raises(WrongAccountKind):
            await pool.settle(reservation, not_an_owner, 1_000, "r", settlement_key(key("r")))
        assert money_snapshot(engine) == before
        again = [await pool.reserve(customer, REQUEST_NANO_USD) for _ in range(2)]
        for r in again:
            await pool.give_back(r)
        await pool.close()
        return pool.pools_placed

    assert asyncio.run(run()) == 1, "both requests fit in the first pool again"


def test_a_settlement_whose_key_was_used_before_forgets_the_reservation(ledger, engine, owner):
    """A request's capture committed but its answer was lost, and its retry
    carries other content: refused, its reservation is forgotten, not given
    back, for the first capture took from the pool's hold unknown to the pool."""
    customer = customer_with(ledger, 10 * USD)

    async def run() -> tuple[int, int, int]:
        pool = HoldPool(ledger, pool_requests=2)
        reservation = await pool.reserve(customer, REQUEST_NANO_USD)
        request_id = key("req")
        ledger.append(cmd.SettleRequest(reservation.hold_id, owner, 1_000, request_id, settlement_key(request_id), {}, False))
        with pytest.raises(IdempotencyConflict):
            await pool.settle(reservation, owner, 2_000, request_id, settlement_key(request_id))
        free, hold = reservation.pool.free_nano_usd, _hold_amounts(engine)[reservation.hold_id]
        await pool.close()
        return free, hold, reservation.pool.in_flight

    free, hold, in_flight = asyncio.run(run())
    assert in_flight == 0 and free <= hold, "never more counted free than the pool's hold has"


def test_a_pool_whose_hold_expired_is_dropped_and_the_next_request_places_another(ledger, engine, owner):
    customer = customer_with(ledger, 10 * USD)

    async def run() -> None:
        pool = HoldPool(ledger, ttl_s=1)
        await _request(pool, customer, owner, 1_000)
        with engine.begin() as conn:
            assert expire_holds(conn, now=utc_now() + timedelta(days=1)) == 1
        await pool.renew()
        await _request(pool, customer, owner, 1_000)
        assert pool.pools_placed == 2, "the expired pool was dropped and another placed"
        await pool.close()

    asyncio.run(run())
    assert ledger.balance(customer).balance_nano_usd == 10 * USD - 2_000 and _active_holds(engine) == 0


def test_a_swept_pools_id_is_never_given_to_another_customers_hold(ledger, engine, owner):
    """Its replica still holds the id: had another customer's new hold got it,
    the renewal would find it active and the next capture charge that customer."""
    customer, other = customer_with(ledger, 10 * USD), customer_with(ledger, 10 * USD)

    async def run() -> tuple[int, int, bool]:
        pool = HoldPool(ledger, ttl_s=1)
        reservation = await pool.reserve(customer, REQUEST_NANO_USD)
        with engine.begin() as conn:
            assert expire_holds(conn, now=utc_now() + timedelta(days=1)) == 1
        others_hold = ledger.place_hold(PlaceHold(other, REQUEST_NANO_USD, key("hold"), 30))
        await pool.renew()
        return reservation.hold_id, others_hold.hold_id, reservation.lost

    swept_id, others_id, lost = asyncio.run(run())
    assert others_id != swept_id and lost, "the swept pool is found gone, its id nobody's"
    assert ledger.balance(other).held_nano_usd == REQUEST_NANO_USD and ledger.balance(other).balance_nano_usd == 10 * USD


def test_a_replica_that_died_with_requests_in_flight_leaves_a_pool_its_restart_releases(ledger, engine, owner):
    """The requests it had in flight had recorded nothing: nothing is charged, everything is freed."""
    customer = customer_with(ledger, 10 * USD)

    async def crashed_run() -> None:
        pool = HoldPool(ledger, replica_id="replica-a")
        await _request(pool, customer, owner, 5_000)
        await pool.reserve(customer, REQUEST_NANO_USD)  # in flight when the process dies: never settled, never closed

    asyncio.run(crashed_run())
    assert ledger.balance(customer).held_nano_usd == 64 * REQUEST_NANO_USD - 5_000
    seen = ledger.holds_of_replica("replica-a")  # as the replica restarted reads them
    assert len(seen) == 1
    assert ledger.settle_orphaned_holds(seen).released == 1
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (10 * USD - 5_000, 0)


def test_a_request_that_runs_long_moves_to_a_hold_of_its_own_and_settles_at_its_recorded_usage_after_a_crash(ledger, engine, owner):
    """Split out of its pool, it records what it delivered like any request's
    hold; the replica dies; its restart settles that and releases the pool."""
    customer = customer_with(ledger, 10 * USD)
    request_id = key("req")

    async def crashed_run() -> int:
        pool = HoldPool(ledger, replica_id="replica-b", pool_requests=4)
        reservation = await pool.reserve(customer, REQUEST_NANO_USD)
        [lost_answer] = ledger.split_holds([(reservation.hold_id, PlaceHold(customer, REQUEST_NANO_USD, f"hold:{request_id}",
                                                                            replica_id="replica-b"))])
        own = await pool.split(reservation, f"hold:{request_id}")  # done again: the first move's answer was lost
        assert (own.status, own.hold_id) == ("exists", lost_answer.hold_id), "a move done again by its key finds the first"
        assert ledger.balance(customer).held_nano_usd == 4 * REQUEST_NANO_USD, "moving changes what is held nowhere"
        assert pool._pools[(customer, None)].free_nano_usd == 3 * REQUEST_NANO_USD and _hold_amounts(engine) == {
            reservation.hold_id: 3 * REQUEST_NANO_USD, own.hold_id: REQUEST_NANO_USD}, "taken from the pool once"
        assert ledger.renew_holds([HoldRenewal(own.hold_id, 30, 7_000_000, owner, request_id, {"model": "m"})]) == {own.hold_id}
        return own.hold_id

    asyncio.run(crashed_run())
    result = ledger.settle_orphaned_holds(ledger.holds_of_replica("replica-b"))
    assert (result.settled, result.released) == (1, 1)
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (10 * USD - 7_000_000, 0)
    assert ledger.balance(owner).balance_nano_usd == 5_600_000


def test_a_split_from_a_pool_that_is_gone_moves_nothing(ledger, engine, owner):
    customer = customer_with(ledger, 10 * USD)

    async def run() -> None:
        pool = HoldPool(ledger)
        reservation = await pool.reserve(customer, REQUEST_NANO_USD)
        assert ledger.release_hold(reservation.hold_id)  # as the sweeper would, had the replica stopped renewing it
        before = money_snapshot(engine)
        with pytest.raises(HoldNotActive):
            await pool.split(reservation, key("hold"))
        assert money_snapshot(engine) == before
        await _request(pool, customer, owner, 1_000)  # the next request places a new pool
        assert pool.pools_placed == 2
        await pool.close()

    asyncio.run(run())


def test_idle_pools_are_released_and_busy_ones_kept(ledger, engine, owner):
    quiet, busy = customer_with(ledger, 10 * USD), customer_with(ledger, 10 * USD)

    async def run() -> None:
        pool = HoldPool(ledger)
        await _request(pool, quiet, owner, 1_000)
        in_flight = await pool.reserve(busy, REQUEST_NANO_USD)
        assert await pool.release_idle(0.0) == 1
        assert (ledger.balance(quiet).held_nano_usd, _active_holds(engine)) == (0, 1)
        await pool.give_back(in_flight)
        assert await pool.release_idle(3600.0) == 0, "used a moment ago"
        await pool.close()

    asyncio.run(run())
    assert _active_holds(engine) == 0


def test_the_last_request_moved_out_of_a_pool_may_leave_it_holding_nothing(ledger, engine, owner):
    customer = customer_with(ledger, 10 * USD)

    async def run() -> None:
        pool = HoldPool(ledger, pool_requests=1)
        own = await pool.split(await pool.reserve(customer, REQUEST_NANO_USD), key("hold"))
        assert ledger.balance(customer).held_nano_usd == REQUEST_NANO_USD
        assert ledger.release_hold(own.hold_id)
        await pool.close()

    asyncio.run(run())
    assert ledger.balance(customer).held_nano_usd == 0 and _active_holds(engine) == 0


def test_moves_of_many_requests_take_each_pool_once_and_refuse_the_requests_of_a_pool_that_is_short(ledger, engine, owner):
    """One transaction for all: a pool's requests move together or not at all."""
    rich, poor = customer_with(ledger, 10 * USD), customer_with(ledger, 10 * USD)

    async def run() -> None:
        pool = HoldPool(ledger, pool_requests=4)
        moving = [await pool.reserve(rich, REQUEST_NANO_USD) for _ in range(3)]
        short = await pool.reserve(poor, REQUEST_NANO_USD)
        with engine.begin() as conn:  # as if its captures had taken nearly all of it
            conn.execute(holds.update().where(holds.c.id == short.hold_id).values(amount_nano_usd=REQUEST_NANO_USD - 1))
        before = money_snapshot(engine)
        results = await pool.split_many([(r, key("hold")) for r in (*moving, short)])
        assert [r.status for r in results[:3]] == ["created"] * 3 and isinstance(results[3], HoldNotActive)
        assert _hold_amounts(engine)[moving[0].hold_id] == REQUEST_NANO_USD, "the rich pool gave up three amounts at once"
        assert _hold_amounts(engine)[short.hold_id] == REQUEST_NANO_USD - 1, "nothing moved out of the short one"
        assert money_snapshot(engine)["balances"] == before["balances"]
        for result in results[:3]:
            assert ledger.release_hold(result.hold_id)
        await pool.close()

    asyncio.run(run())


def test_a_pool_is_released_once_even_when_retired_twice(ledger, engine, owner):
    """SQLite gives a deleted hold's id to the next hold placed: a pool released
    twice (a replacement racing an idle release) would release that hold."""
    customer = customer_with(ledger, 10 * USD)

    async def run() -> None:
        pool = HoldPool(ledger)
        first = await pool.reserve(customer, REQUEST_NANO_USD)
        await pool.give_back(first)
        retired = first.pool
        await pool._retire(retired)
        other = ledger.place_hold(PlaceHold(customer, REQUEST_NANO_USD, key("hold")))  # perhaps under the released id
        await pool._retire(retired)
        assert _hold_amounts(engine) == {other.hold_id: REQUEST_NANO_USD}, "the other hold is still there"
        assert ledger.release_hold(other.hold_id)

    asyncio.run(run())
