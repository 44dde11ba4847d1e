"""A replica's requests reserved in memory against pooled holds: no hold row per request.

One hold per customer (and spend limit) serves many requests. It is placed
like any hold, checked against the customer's available balance and the
key's spend limit in the transaction that places it, so every replica sees
it as reserved at once. Each request then reserves its amount from the
pool's hold in this process; its settlement is a capture that is not final
(`SettleRequest.final_capture=False`), which takes only its charge from the
hold and leaves the rest for the next request; a request that ends with no
charge gives its amount back in memory. A pool whose hold has too little
left is retired, and released once its last request is settled; a new one
is placed. The durable path then writes no hold row, and closes none, per
request: one hold's row is updated per batch. A request that runs long
enough to record what it delivers (renewals) moves to a hold of its own
(`split_many`), where it records it as any request's hold does.

What the pools' holds reserve and nobody uses is credit a customer cannot
spend through another replica for a moment (as a settled request's hold
is, until its release). A pool is `HOLD_POOL_REQUESTS` requests' amounts,
placed whole or not at all: where the customer's available credit (or the
key's spend limit) does not cover a whole pool, `reserve` answers None and
the request places a hold of its own, as it would without pools, for
`HOLD_POOL_RETRY_S`. A customer short of credit then never has a pool
holding what another replica's request could have used.

Runs on one event loop: the reservations are plain arithmetic between awaits.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import NamedTuple

from ledger import commands as cmd
from ledger.errors import HoldNotActive, IdempotencyConflict, InsufficientFunds, LedgerError, SpendLimitReached
from ledger.hold_commands import HoldRenewal, HoldResult, PlaceHold
from ledger.limits import HOLD_POOL_REQUESTS, HOLD_POOL_RETRY_S, HOLD_TTL_S_DEFAULT
from ledger.service import Ledger

log = logging.getLogger(__name__)


class _Pool:
    __slots__ = ("key", "hold_id", "free_nano_usd", "in_flight", "retired", "gone", "released", "used_at_s")

    def __init__(self, key: tuple[int, int | None], hold_id: int, amount_nano_usd: int) -> None:
        self.key = key  # (customer, spend limit)
        self.hold_id = hold_id
        self.free_nano_usd = amount_nano_usd  # the hold's amount less what this process's requests reserve
        self.in_flight = 0
        self.retired = False
        self.gone = False  # its hold was closed elsewhere (the sweeper): nothing to release
        # Released by this pool: never twice (a second release would only find it gone).
        self.released = False
        self.used_at_s = time.monotonic()  # when a request last reserved from it or ended


class Reservation(NamedTuple):
    """One request's share of a pooled hold."""

    pool: _Pool
    amount_nano_usd: int

    @property
    def hold_id(self) -> int:
        return self.pool.hold_id

    @property
    def lost(self) -> bool:
        """Its pool's hold was closed elsewhere (the sweeper): nothing reserves for it any more."""
        return self.pool.gone


class HoldPool:
    def __init__(self, ledger: Ledger, *, replica_id: str | None = None, ttl_s: int = HOLD_TTL_S_DEFAULT,
                 pool_requests: int = HOLD_POOL_REQUESTS) -> None:
        self.ledger = ledger
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self.pool_requests = pool_requests
        self._pools: dict[tuple[int, int | None], _Pool] = {}  # (customer, spend limit): the pool requests reserve from
        self._placing: dict[tuple[int, int | None], asyncio.Future] = {}  # a pool being placed: the others wait for it
        self._retired: set[_Pool] = set()  # retired, with requests still in flight
        # (customer, spend limit): when a pool may be tried again after one was refused
        self._unpooled_until_s: dict[tuple[int, int | None], float] = {}
        self.pools_placed = 0

    async def reserve(self, account_id: int, amount_nano_usd: int, *, spend_limit_id: int | None = None) -> Reservation | None:
        """Reserve `amount_nano_usd` for one request from its customer's pool;
        None when no whole pool can be placed (the customer's credit or the
        key's limit falls short of one): the request then holds its own."""
        pool_key = (account_id, spend_limit_id)
        while True:
            pool = self._pools.get(pool_key)
            if pool is not None and pool.free_nano_usd >= amount_nano_usd:
                pool.free_nano_usd -= amount_nano_usd
                pool.in_flight += 1
                pool.used_at_s = time.monotonic()
                return Reservation(pool, amount_nano_usd)
            placing = self._placing.get(pool_key)
            if placing is not None:
                await placing  # its error is its placer's; this request tries again
                continue
            if time.monotonic() < self._unpooled_until_s.get(pool_key, 0.0):  # past ones pruned by release_idle
                return None
            await self._replace(pool_key, pool, amount_nano_usd)

    async def _replace(self, pool_key: tuple[int, int | None], old: _Pool | None, amount_nano_usd: int) -> None:
        """Place a pool for `pool_key` and retire the one that had too little
        left. Refused, the old one stays (its requests may settle, and those
        that fit may still reserve from it) unless nothing is in flight in it:
        then it is released, and the new one is asked for once more. Refused
        again, the key's requests hold their own for `HOLD_POOL_RETRY_S`."""
        placing = self._placing[pool_key] = asyncio.get_running_loop().create_future()
        asked_nano_usd = amount_nano_usd * self.pool_requests
        try:
            hold = await self._place(pool_key, asked_nano_usd)
            if hold is None and old is not None and not old.in_flight:
                await self._retire(old)
                old = None
                hold = await self._place(pool_key, asked_nano_usd)
            if hold is None:
                self._unpooled_until_s[pool_key] = time.monotonic() + HOLD_POOL_RETRY_S
                return
            if old is not None:
                await self._retire(old)
            self._pools[pool_key] = _Pool(pool_key, hold.hold_id, hold.amount_nano_usd)
            self.pools_placed += 1
        finally:
            del self._placing[pool_key]
            placing.set_result(None)

    async def _place(self, pool_key: tuple[int, int | None], amount_nano_usd: int) -> HoldResult | None:
        """A whole pool's hold, or None where the customer's credit or the key's limit falls short of it."""
        account_id, spend_limit_id = pool_key
        try:
            return await self.ledger.place_hold_async(PlaceHold(
                account_id, amount_nano_usd, f"pool:{self.replica_id or '-'}:{uuid.uuid4().hex}",
                self.ttl_s, spend_limit_id=spend_limit_id, replica_id=self.replica_id))
        except (InsufficientFunds, SpendLimitReached):
            return None

    async def _retire(self, pool: _Pool) -> None:
        """No new request reserves from it; released now if nothing is in flight, else by its last settlement."""
        pool.retired = True
        if self._pools.get(pool.key) is pool:
            del self._pools[pool.key]
        if pool.in_flight:
            self._retired.add(pool)
        else:
            await self._release(pool)

    async def _release(self, pool: _Pool) -> None:
        """Its hold released. Should the database be away, the hold expires
        untouched (it records nothing) and the sweeper, or this replica's next
        start, releases it: no request waits for that."""
        if pool.released or pool.gone:
            return
        pool.released = True
        try:
            await asyncio.to_thread(self.ledger.release_hold, pool.hold_id)
        except Exception:
            log.warning("pooled hold %s is left to expire: it could not be released now", pool.hold_id, exc_info=True)

    async def settle(self, reservation: Reservation, owner_account_id: int, charge_nano_usd: int, request_id: str,
                     idempotency_key: str, meta: dict | None = None):
        """Capture the request's charge from its pool's hold (not finally) and
        tell the pool (`captured`, `refused`). Returns the AppendResult."""
        try:
            result = await self.ledger.append_async(cmd.SettleRequest(
                reservation.hold_id, owner_account_id, charge_nano_usd, request_id, idempotency_key, meta or {}, False))
        except LedgerError as exc:
            await self.refused(reservation, exc)
            raise
        await self.captured(reservation, charge_nano_usd)
        return result

    async def captured(self, reservation: Reservation, charge_nano_usd: int) -> None:
        """The request's charge was captured from the pool's hold: the rest of its reservation is free for the next."""
        await self._done(reservation, reservation.amount_nano_usd - charge_nano_usd)

    async def refused(self, reservation: Reservation, error: LedgerError) -> None:
        """The capture was refused: nothing was taken. A hold that is gone (or
        short) is dropped: no request reserves from it again. A key used
        before (IdempotencyConflict) is a settlement of this request that may
        have taken from the hold: the reservation is forgotten, not given back."""
        if isinstance(error, IdempotencyConflict):
            await self.forget(reservation)
            return
        if isinstance(error, HoldNotActive):
            self._drop(reservation.pool)
        await self.give_back(reservation)

    async def forget(self, reservation: Reservation) -> None:
        """A reservation whose amount may or may not have left the pool's hold
        (a move to a hold of its own whose outcome is not known): no longer in
        flight, and not counted free, so the pool never counts more free than its hold has."""
        await self._done(reservation, 0)

    async def give_back(self, reservation: Reservation) -> None:
        """A request that ends with nothing charged: its whole reservation is free again."""
        await self._done(reservation, reservation.amount_nano_usd)

    async def split(self, reservation: Reservation, idempotency_key: str) -> HoldResult:
        """`split_many` of one: its HoldResult, or its error raised."""
        [result] = await self.split_many([(reservation, idempotency_key)])
        if isinstance(result, LedgerError):
            raise result
        return result

    async def split_many(self, moves: list[tuple[Reservation, str]]) -> list[HoldResult | LedgerError]:
        """Move requests that run long enough to record what they deliver
        (renewals) out of their pools, each into a hold of its own keyed by
        `idempotency_key` (`Ledger.split_holds`, one transaction for all),
        which it then renews, settles finally, or releases like any. One result
        per move: a pool whose hold is gone refuses its requests with
        HoldNotActive, and their reservations are given back. A failure of the
        database is raised for all: whether they moved is not known (a move
        done again by its key answers `exists`)."""
        if not moves:
            return []
        results = await asyncio.to_thread(self.ledger.split_holds, [
            (r.hold_id, PlaceHold(r.pool.key[0], r.amount_nano_usd, key, self.ttl_s, spend_limit_id=r.pool.key[1],
                                  replica_id=self.replica_id)) for r, key in moves])
        for (reservation, _), result in zip(moves, results, strict=True):
            if isinstance(result, HoldNotActive):
                self._drop(reservation.pool)
                await self.give_back(reservation)
            else:  # moved, its amount with it; or refused otherwise (its key used before), and no longer the pool's
                await self._done(reservation, 0)
        return results

    async def _done(self, reservation: Reservation, freed_nano_usd: int) -> None:
        pool = reservation.pool
        pool.free_nano_usd += freed_nano_usd
        pool.in_flight -= 1
        pool.used_at_s = time.monotonic()
        if pool.in_flight or pool.gone:
            return
        if pool.retired:
            self._retired.discard(pool)
            await self._release(pool)

    async def renew(self) -> None:
        """Push back the expiry of every pool's hold (the proxy's renewal loop
        calls this with its requests' renewals); a pool whose hold is gone
        (taken by the sweeper) is dropped, and the next request places a new one."""
        pools = [*self._pools.values(), *self._retired]
        if not pools:
            return
        active = await asyncio.to_thread(self.ledger.renew_holds, [HoldRenewal(p.hold_id, self.ttl_s) for p in pools])
        for pool in pools:
            if pool.hold_id not in active:
                self._drop(pool)

    async def release_idle(self, idle_s: float) -> int:
        """Release the pools nothing has reserved from or ended in for `idle_s`:
        what they hold is the customer's to spend through any replica again.
        Returns how many."""
        now_s = time.monotonic()
        self._unpooled_until_s = {k: until for k, until in self._unpooled_until_s.items() if until > now_s}
        idle = [p for p in self._pools.values() if not p.in_flight and now_s - p.used_at_s >= idle_s]
        for pool in idle:
            await self._retire(pool)
        return len(idle)

    def _drop(self, pool: _Pool) -> None:
        """A pool whose hold is gone: nothing to release, no request reserves from it."""
        pool.retired = pool.gone = True
        self._retired.discard(pool)
        if self._pools.get(pool.key) is pool:
            del self._pools[pool.key]

    async def close(self) -> None:
        """Release every pool with nothing in flight (as a replica shuts down)."""
        for pool in list(self._pools.values()):
            await self._retire(pool)
