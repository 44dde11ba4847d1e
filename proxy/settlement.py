"""Settling generations (DESIGN.md, A request through the proxy, step 5, and
Metering rules): charge what was delivered, pay the worker's owner, release
the rest of the hold, record a worker's over-report as evidence. And, while
requests run, renew their holds with what each has delivered so far.

`Settler.settle` is the callback a `Generation` hands itself to when its
stream ends; it runs the settlement in a task of its own, which nothing the
caller does can cancel and which shutdown awaits."""
from __future__ import annotations

import asyncio
import logging
import time

import orjson

from ledger import commands as cmd
from ledger.db import is_connection_failure
from ledger.errors import DatabaseUnavailable, HoldNotActive, IdempotencyConflict, InsufficientFunds, LedgerError, SpendLimitReached, WriterOverloaded
from ledger.hold_pool import HoldPool, Reservation
from ledger.holds import HoldRenewal, HoldResult, PlaceHold, settlement_key
from ledger.service import Ledger
from proxy import generations, metering
from proxy import workers as registry
from proxy.directory import Directory
from proxy import unbilled
from proxy.generation import CANCELLED, FAILED_MID_STREAM, Generation
from proxy.generations import rest_key, withheld_key
from proxy.limits import (
    HOLD_POOL_IDLE_S,
    HOLD_RENEW_INTERVAL_S_MAX,
    HOLD_RENEWALS_PER_TTL_MIN,
    SETTLE_ATTEMPTS_MAX,
    SETTLE_OUTAGE_RETRY_INTERVAL_S,
    SETTLE_OUTAGE_RETRY_S_MAX,
    SHUTDOWN_DATABASE_WAIT_S,
    SETTLE_RETRY_WAIT_S,
    USAGE_PROBE_TIMEOUT_S,
)
from proxy.upstream import UpstreamError, UpstreamPool
from proxy.withheld import WithheldJournal

log = logging.getLogger(__name__)


def hold_key(request_id: str) -> str:
    return f"hold:{request_id}"


class Settler:
    def __init__(self, ledger: Ledger, directory: Directory, upstream: UpstreamPool, *, hold_ttl_s: int,
                 replica_id: str | None = None, journal: WithheldJournal | None = None, pool: HoldPool | None = None) -> None:
        self.ledger = ledger
        self.pool = pool  # PARALON_HOLD_POOLS: requests reserved from this replica's pooled holds
        self.directory = directory  # its loads: what this process has in flight per worker
        self.upstream = upstream
        self.hold_ttl_s = hold_ttl_s
        self.replica_id = replica_id
        self._background: set[asyncio.Task] = set()
        self._live: dict[str, Generation] = {}  # request id: its request, until it settles or releases
        self.journal = journal  # withheld answers whose reversal is owed, kept across restarts
        self._stop_at_s: float | None = None  # set once shutdown starts: every wait ends by then
        self.unbilled = unbilled.UnbilledLog(ledger.engine)  # requests that ended with nothing charged

    def settle(self, generation: Generation, charge: bool) -> asyncio.Task:
        """Bill what was delivered, or, with charge=False (a non-streaming
        caller whose worker failed has received nothing), release the hold."""
        return self.in_background(self.finish(generation) if charge else self.abandon(generation))

    def track(self, generation: Generation) -> None:
        """Its hold is placed: renew it while the request runs."""
        self._live[generation.request_id] = generation

    # After the last token
    async def finish(self, generation: Generation) -> None:
        """Settle what was delivered, durably, then the response may end."""
        if not generation.begin_settling():
            return
        load = self.directory.loads.get(generation.worker.id)
        if load is not None:
            load.in_flight -= 1
        self._book_relayed(generation)
        if generation.reported_prompt is None and generation.counted_tokens:
            await self._ask_prompt_tokens(generation)
        billed = generation.delivered_usage()
        generation.bill(billed)
        if billed.completion_tokens == 0:  # an empty completion costs nothing
            await self.release(generation)
            self.unbilled.note(generation, *_nothing_billed(generation))
            return
        try:
            await self._settle_delivered(generation, billed)
        except Exception as exc:  # a refusal, or the database away: the charge is not lost either way
            await self._settle_later(generation, billed, database_away=_database_away(exc))
            if generation.settle_failed:
                self.unbilled.note(generation, unbilled.FAILED, unbilled.WITHHELD)
        finally:
            self._live.pop(generation.request_id, None)
        if billed.discrepant:  # evidence is recorded off the path to [DONE]
            self.in_background(self._record_discrepancy(generation, billed))

    async def abandon(self, generation: Generation) -> None:
        if not generation.begin_settling():
            return
        if generation.worker is not None:
            self.directory.loads[generation.worker.id].in_flight -= 1
        await self.release(generation)
        self.unbilled.note(generation, unbilled.FAILED, unbilled.WORKER_FAILED)

    async def release(self, generation: Generation) -> None:
        self._live.pop(generation.request_id, None)
        if getattr(generation, "reservation", None) is not None and await self._give_back(generation):
            return
        # Shielded: a caller leaving must not stop the release once it is due.
        await asyncio.shield(asyncio.to_thread(self.ledger.release_hold, generation.hold_id))

    def release_when_placed(self, placing: asyncio.Future) -> None:
        """A done-callback for a hold whose caller left before it was placed."""
        if placing.cancelled() or placing.exception() is not None:
            return
        held = placing.result()
        if isinstance(held, Reservation):
            self.in_background(self.pool.give_back(held))
        else:
            self.in_background(asyncio.to_thread(self.ledger.release_hold, held.hold_id))

    async def _settle_later(self, generation: Generation, billed: metering.BilledUsage, *, database_away: bool) -> None:
        """The settlement could not be written (the database or the writer is
        away). Delivered tokens are never given away: a streaming caller has
        them, so the hold keeps the full charge as its recorded usage, the
        settlement is tried again once the database is back, and should this
        process stop first the sweeper settles the hold once it expires. A
        non-streaming caller has received nothing: the hold is released (or
        expires, if the database is away) and the answer withheld."""
        if not generation.streaming:
            log.warning("request %s could not be settled; nothing was delivered, its hold is released",
                        generation.request_id, exc_info=not database_away)
            if database_away:  # before the 503: the reversal owed must outlive this process
                await self._journal_withheld(generation.request_id)
            generation.withhold()
            try:
                if not (getattr(generation, "capture_unknown", False) and await self._forget_reservation(generation)):
                    await self.release(generation)
            except Exception:  # the sweeper releases it once it expires
                log.warning("request %s: its hold is left to expire", generation.request_id, exc_info=True)
            if database_away:
                self.in_background(self._when_back(generation.request_id, self._reverse_withheld, generation.request_id))
            return
        log.warning("request %s could not be settled now", generation.request_id, exc_info=not database_away)
        if generation.capture_unknown:  # a move now could take its amount from the pool's hold a second time
            self.in_background(self._settle_when_back(generation, billed))
            return
        try:
            await self._record_delivered(generation, billed)
        except Exception:  # the hold keeps the usage recorded at the last renewal
            log.warning("request %s: its hold keeps the usage last recorded", generation.request_id, exc_info=not database_away)
        if database_away:  # the same idempotency key makes every try safe; a hold the sweeper settled is found
            self.in_background(self._settle_when_back(generation, billed))
        else:  # nothing tries again: a share of a pool it still has is forgotten, so that the pool is released in time
            await self._forget_reservation(generation)

    async def _forget_reservation(self, generation: Generation) -> bool:
        """Its share of a pool, if it still has one, forgotten: never given
        back, for a capture or a move whose outcome is not known may have
        taken it from the pool's hold (the pool then counts less free than its
        hold has, never more). True when it had one: then it has no hold of
        its own to release."""
        async with generation.hold_lock:
            return await self._end_reservation(generation, HoldPool.forget)

    async def _end_reservation(self, generation: Generation, end) -> bool:
        """Under its hold lock: its share of a pool taken off it and ended by
        `end(pool, reservation)` (`HoldPool.give_back`, `forget` or a capture);
        False if it had none (then there may be no pool at all)."""
        reservation, generation.reservation = generation.reservation, None
        if reservation is None:
            return False
        await end(self.pool, reservation)
        return True

    async def _record_delivered(self, generation: Generation, billed: metering.BilledUsage) -> None:
        """What a stream delivered, recorded on its hold (a pooled request's
        moved to a hold of its own first), which the sweeper settles."""
        await self._split(generation)
        await asyncio.shield(asyncio.to_thread(self.ledger.renew_holds, [self.renewal(generation, billed)]))

    async def _settle_when_back(self, generation: Generation, billed: metering.BilledUsage) -> None:
        """Its settlement, sent again by its key once the database answers
        (found if it committed). A pooled capture whose outcome is still not
        known when the tries end is looked up: found, it counts as captured;
        absent, the stream records what it delivered on a hold of its own,
        which the sweeper settles. A share of a pool still held then is
        forgotten, so that the pool is released in time."""
        await self._when_back(generation.request_id, self._settle_delivered, generation, billed)
        if generation.capture_unknown and generation.reservation is not None:
            try:
                await self._capture_found_or_recorded(generation, billed)
            except Exception:  # the database still away: nothing can record it now
                log.error("request %s: its capture's outcome is not known and nothing records it", generation.request_id,
                          exc_info=True)
        await self._forget_reservation(generation)

    async def _capture_found_or_recorded(self, generation: Generation, billed: metering.BilledUsage) -> None:
        first = await asyncio.to_thread(self._settled, generation.request_id)
        if first is not None:
            async with generation.hold_lock:
                await self._end_reservation(generation, lambda pool, reservation: pool.captured(reservation, first.charge_nano_usd))
            generation.charged(first.charge_nano_usd)
            return
        generation.capture_unknown = False  # known now: nothing was captured, so a move takes nothing twice
        try:
            await self._record_delivered(generation, billed)
        except HoldNotActive:  # its pool's hold is gone: charged under a new hold of its own
            await self._settle_rest(generation, _settlement_meta(generation, billed))

    async def _journal_withheld(self, request_id: str) -> None:
        if self.journal is None:
            return
        try:
            await asyncio.shield(asyncio.to_thread(self.journal.record, request_id))
        except Exception:  # the reversal is still tried from memory while this process runs
            log.exception("request %s: the withheld journal could not record it", request_id)

    def resume_withheld(self) -> int:
        """At start: reverse, once the database answers, what a previous run withheld."""
        pending = self.journal.pending() if self.journal is not None else []
        for request_id in pending:
            self.in_background(self._when_back(request_id, self._reverse_withheld, request_id))
        if pending:
            log.warning("%d withheld answer(s) from a previous run are reversed once the database answers", len(pending))
        return len(pending)

    async def _when_back(self, request_id: str, work, *args) -> None:
        """`await work(*args)` once the database answers again (tried every
        interval, for a bounded time); work that fails otherwise is logged."""
        deadline_s = time.monotonic() + SETTLE_OUTAGE_RETRY_S_MAX
        while time.monotonic() < min(deadline_s, self._stop_at_s or deadline_s):
            await asyncio.sleep(SETTLE_OUTAGE_RETRY_INTERVAL_S)
            try:
                await work(*args)
            except Exception as exc:
                if _database_away(exc):
                    continue
                log.exception("request %s: %s failed", request_id, work.__name__)
                return
            log.info("request %s: %s done once the database was back", request_id, work.__name__)
            return
        log.error("request %s: the database stayed away; %s was not done", request_id, work.__name__)

    async def _reverse_withheld(self, request_id: str) -> None:
        """A withheld answer costs nothing. The database may have gone away
        while the settlement's commit was on its way, and committed it all the
        same: such a settlement is reversed (once: the key is the request's)."""
        for seq in await asyncio.to_thread(self._settlement_seqs, request_id):
            await self._append(cmd.ReverseEvent(seq, "the answer was withheld: its settlement's outcome was not known in time",
                                                withheld_key(request_id, seq)))
        if self.journal is not None:
            await asyncio.to_thread(self.journal.done, request_id)

    def _settlement_seqs(self, request_id: str) -> list[int]:
        with self.ledger.engine.connect() as conn:
            return generations.settlement_seqs(conn, request_id)

    async def _settle_delivered(self, generation: Generation, billed: metering.BilledUsage) -> None:
        """Charge the hold. A settlement never depends on its hold still being
        there: if the sweeper closed it (this process could not renew it in
        time), it settled what was recorded as delivered, and the rest is
        charged now, under a hold of its own. So is the part of a long prompt
        above its hold, when the worker that served it counted more than the
        worker whose count sized the hold."""
        meta = _settlement_meta(generation, billed)
        covered = _covered_by_hold(generation, billed)
        charge = generation.price.charge_nano_usd(covered.prompt_tokens, covered.completion_tokens)
        async with generation.hold_lock:  # not while its move to a hold of its own is on its way
            if generation.split_pending:
                try:
                    await self._split_held(generation)
                except HoldNotActive:  # its pool's hold is gone, and nothing of it was captured: charged under a hold of its own
                    await self._settle_rest(generation, meta)
                    return
            reservation = generation.reservation  # pooled: a capture that is not final, the rest left in the pool's hold
            try:
                await self._append(cmd.SettleRequest(generation.hold_id, generation.worker.owner_account_id, charge,
                                                     generation.request_id, settlement_key(generation.request_id),
                                                     _settlement_meta(generation, covered), reservation is None))
            except (HoldNotActive, IdempotencyConflict) as exc:
                if reservation is not None:
                    generation.reservation = None
                    await self.pool.refused(reservation, exc)
                await self._settle_rest(generation, meta)
                return
            except Exception as exc:
                # Committed, perhaps: its charge may have left the pool's hold. Sent
                # again by its key, it is found or made; never counted free meanwhile.
                if reservation is not None and _database_away(exc):  # a later try's refusal does not make it known
                    generation.capture_unknown = True
                raise
            if reservation is not None:
                generation.reservation = None
                await self.pool.captured(reservation, charge)
        if covered != billed:
            await self._settle_rest(generation, meta)

    async def _settle_rest(self, generation: Generation, meta: dict) -> None:
        rid, grant = generation.request_id, generation.grant
        first = await asyncio.to_thread(self._settled, rid)
        charged = first.charge_nano_usd if first else 0
        rest = generation.cost_nano_usd - charged
        generation.charged(charged)
        if rest <= 0:
            return
        rest_meta = {**meta, "prompt_tokens": meta["prompt_tokens"] - (first.prompt_tokens if first else 0),
                     "completion_tokens": meta["completion_tokens"] - (first.completion_tokens if first else 0)}
        try:
            hold = await self.ledger.place_hold_async(PlaceHold(
                grant.account_id, rest, rest_key(hold_key(rid)), self.hold_ttl_s, minimum_nano_usd=1,
                spend_limit_id=grant.spend_limit_id, replica_id=self.replica_id))
        except (InsufficientFunds, SpendLimitReached):
            log.warning("request %s: %s nano-USD delivered after its hold closed are not covered any more", rid, rest)
            return
        try:
            await self._append(cmd.SettleRequest(hold.hold_id, generation.worker.owner_account_id, hold.amount_nano_usd, rid,
                                                 rest_key(settlement_key(rid)), rest_meta))
        except LedgerError:
            await asyncio.to_thread(self.ledger.release_hold, hold.hold_id)
            raise
        generation.charged(charged + hold.amount_nano_usd)

    def _settled(self, request_id: str) -> generations.Settled | None:
        with self.ledger.engine.connect() as conn:
            return generations.first_settlement(conn, request_id)

    async def _append(self, command: cmd.Command):
        for attempt in range(1, SETTLE_ATTEMPTS_MAX + 1):
            try:
                return await self.ledger.append_async(command)
            except WriterOverloaded:  # the idempotency key makes another try safe
                if attempt == SETTLE_ATTEMPTS_MAX:
                    raise
                await asyncio.sleep(SETTLE_RETRY_WAIT_S * attempt)

    async def _ask_prompt_tokens(self, generation: Generation) -> None:
        """llama-cpp-python streams no usage. Ask it for one token of the same
        prompt without streaming: its KV cache still holds the prompt, so the
        answer costs about one decode step and carries the exact prompt count.
        Should that fail, the prompt's upper bound is billed."""
        body = {**generation.upstream_body, "stream": False, "max_tokens": 1}
        body.pop("stream_options", None)
        response = None
        try:
            async with asyncio.timeout(USAGE_PROBE_TIMEOUT_S):
                response = await self.upstream.post(generation.upstream_url(), orjson.dumps(body))
                prompt_tokens = orjson.loads(await response.read())["usage"]["prompt_tokens"]
        except (UpstreamError, ValueError, KeyError, TypeError, TimeoutError):
            return
        finally:
            if response is not None:
                response.close()
        if type(prompt_tokens) is int and prompt_tokens >= 0:
            generation.note_prompt_tokens(prompt_tokens)

    async def _record_discrepancy(self, generation: Generation, billed: metering.BilledUsage) -> None:
        """Every discrepancy is recorded; a strike follows only from proof on
        this request, or from the same inflation across accounts (proxy/workers.py)."""
        discrepancy, proof = discrepancy_of(generation, billed)
        try:
            await asyncio.to_thread(self._strike, discrepancy, proof)
        except Exception:  # the charge is settled already; the evidence is what is lost
            log.exception("the usage discrepancy of request %s could not be recorded", generation.request_id)

    def _strike(self, discrepancy: cmd.RecordUsageDiscrepancy, proof: bool) -> None:
        with self.ledger.engine.begin() as conn:
            registry.record_usage_discrepancy(conn, discrepancy, proof=proof)

    # While requests run
    async def keep_holds(self) -> None:
        """Renew the holds of every request still running, and record what each
        stream has delivered, in one write per interval: a long request never
        outlives its hold, and after a crash the sweeper settles each hold at
        what its caller had received."""
        interval_s = min(HOLD_RENEW_INTERVAL_S_MAX, self.hold_ttl_s / HOLD_RENEWALS_PER_TTL_MIN)
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.renew_holds_once()
            except Exception:  # one round's fault must not end the renewals: every hold would expire
                log.exception("a round of hold renewals failed")

    async def renew_holds_once(self) -> None:
        live = [g for g in list(self._live.values()) if not g.finished]
        for generation in live:
            self._book_relayed(generation)
        if self.pool is not None:
            await self._renew_pools(live)
            live = [g for g in live if getattr(g, "reservation", None) is None and not g.finished]
        renewals = [self.renewal(g) for g in live]
        if not renewals:
            return
        try:
            active = await asyncio.to_thread(self.ledger.renew_holds, renewals)
        except Exception:  # the database is away: try again next round; settlement does not need the hold
            log.warning("could not renew %d hold(s)", len(renewals), exc_info=True)
            return
        for generation, renewal in zip(live, renewals, strict=True):
            # Gone: the sweeper took it, and the stream stops (the rest is charged at the
            # end); or the request settled, and closed it, while this renewal was on its way.
            if renewal.hold_id not in active and not generation.finished:
                self._live.pop(generation.request_id, None)
                generation.lose_hold()

    async def _renew_pools(self, live: list[Generation]) -> None:
        """A pooled stream that has delivered something moves to a hold of its
        own, which records it from now on; the pools' holds are renewed, and
        those idle released. A request whose pool's hold is gone loses its hold."""
        await self._move_delivering([g for g in live if getattr(g, "reservation", None) is not None and _records_delivery(g)
                                     and not g.hold_lock.locked()])  # one that is settling or releasing needs no hold of its own
        try:
            await self.pool.renew()
            await self.pool.release_idle(HOLD_POOL_IDLE_S)
        except Exception:  # the database is away: the next round tries again
            log.warning("could not renew the pooled holds", exc_info=True)
        for generation in live:
            reservation = getattr(generation, "reservation", None)
            if reservation is not None and reservation.lost and not generation.finished:
                self._live.pop(generation.request_id, None)
                generation.reservation = None
                generation.lose_hold()

    async def _move_delivering(self, delivering: list[Generation]) -> None:
        """Every pooled stream that has delivered something moves to a hold of
        its own, in one transaction (`HoldPool.split_many`), each under its hold lock."""
        if not delivering:
            return
        for generation in delivering:
            await generation.hold_lock.acquire()  # free (checked just before): taken without a wait
        try:
            try:
                results = await self.pool.split_many([(g.reservation, hold_key(g.request_id)) for g in delivering])
            except Exception as exc:  # the database away: whether they moved is not known; the next use moves them again
                log.warning("could not move %d request(s) to holds of their own: %r", len(delivering), exc)
                for generation in delivering:
                    generation.split_pending = True
                return
            for generation, result in zip(delivering, results, strict=True):
                self._moved(generation, result)
        finally:
            for generation in delivering:
                generation.hold_lock.release()

    def _moved(self, generation: Generation, result: HoldResult | LedgerError) -> None:
        """A move's outcome: its own hold from now on, or none (its pool's hold is gone)."""
        if isinstance(result, LedgerError):
            generation.reservation, generation.split_pending = None, False
            if not generation.finished:
                self._live.pop(generation.request_id, None)
                generation.lose_hold()
            return
        generation.reservation, generation.split_pending, generation.hold_id = None, False, result.hold_id

    async def _give_back(self, generation: Generation) -> bool:
        """A pooled request released: its reservation back to the pool, nothing
        written. False when it has moved to a hold of its own, to be released.
        A move whose outcome is not known is done again first; if the database
        is away, the reservation is forgotten, not given back (its pool then
        counts less free than it has, never more)."""
        async with generation.hold_lock:
            if generation.split_pending:
                try:
                    await self._split_held(generation)
                except HoldNotActive:
                    return True
                except Exception:
                    generation.split_pending = False  # a move refused otherwise than as gone has left the pool already
                    await self._end_reservation(generation, HoldPool.forget)
                    return True
            return await self._end_reservation(generation, HoldPool.give_back)

    async def _split(self, generation: Generation) -> None:
        """A pooled request's reservation moved to a hold of its own (`HoldPool.split`)."""
        if getattr(generation, "reservation", None) is None:
            return
        async with generation.hold_lock:  # not while it settles or releases
            await self._split_held(generation)

    async def _split_held(self, generation: Generation) -> None:
        """`_split` under the request's hold lock. A move whose outcome is not
        known (the database away) is done again, by its key, before the
        reservation is used otherwise (`split_pending`)."""
        reservation = generation.reservation
        if reservation is None:
            return
        try:
            [result] = await self.pool.split_many([(reservation, hold_key(generation.request_id))])
        except Exception:
            generation.split_pending = True
            raise
        self._moved(generation, result)
        if isinstance(result, LedgerError):  # its pool's hold is gone: it has none
            raise result

    def _book_relayed(self, generation: Generation) -> None:
        """What a request relayed since it was last booked counts as its
        worker's delivery (proxy/capacity.py): each second, not per chunk."""
        worker = getattr(generation, "worker", None)  # an embedding request (HeldRequest) books no relayed tokens
        load = self.directory.loads.get(worker.id) if worker is not None else None
        if load is not None:
            load.relayed_tokens += generation.counted_tokens - generation.relayed_booked
            generation.relayed_booked = generation.counted_tokens

    def renewal(self, generation: Generation, billed: metering.BilledUsage | None = None) -> HoldRenewal:
        """What a stream's caller has received is delivered; a non-streaming
        caller has received nothing until the answer is complete. The usage is
        written only when it changed; a prompt the worker has not reported yet
        (llama.cpp) is not charged on a crash rather than charged at its bound."""
        renewal = HoldRenewal(generation.hold_id, self.hold_ttl_s)
        if not _records_delivery(generation):
            return renewal
        billed = billed or generation.delivered_usage()
        if generation.reported_prompt is None:
            billed = billed._replace(prompt_tokens=0)
        capture = min(generation.price.charge_nano_usd(billed.prompt_tokens, billed.completion_tokens), generation.hold_nano_usd)
        if not generation.record_capture(capture):
            return renewal
        return renewal._replace(capture_nano_usd=capture, owner_account_id=generation.worker.owner_account_id,
                                request_id=generation.request_id, meta=_settlement_meta(generation, billed))

    # Background work
    def in_background(self, work) -> asyncio.Task:
        """A task nothing the caller does can cancel, awaited at shutdown."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drain_background(self) -> None:
        """Wait for the background work. What still waits for the database is
        given a little while, then stopped: its holds carry what was delivered,
        and the sweeper of any replica settles them; a withheld answer's
        reversal is in the journal. One deadline, set now, bounds every wait,
        work that starts waiting during the drain included."""
        self._stop_at_s = time.monotonic() + SHUTDOWN_DATABASE_WAIT_S
        while self._background:
            left_s = self._stop_at_s - time.monotonic()
            if left_s <= 0:
                break
            await asyncio.wait(list(self._background), timeout=left_s)
        remaining = list(self._background)
        if remaining:
            log.warning("%d background task(s) stopped at shutdown", len(remaining))
        for task in remaining:
            task.cancel()
        await asyncio.gather(*remaining, return_exceptions=True)
        await self.unbilled.flush()
        if self.pool is not None:
            try:
                await self.pool.close()
            except Exception:  # its holds expire, or this replica's next start releases them
                log.warning("could not release the pooled holds at shutdown", exc_info=True)


def _records_delivery(generation: Generation) -> bool:
    """Whether its renewals record delivered usage: a stream that has relayed something."""
    return generation.streaming and generation.worker is not None and generation.counted_tokens > 0


def _database_away(exc: BaseException) -> bool:
    return isinstance(exc, DatabaseUnavailable) or is_connection_failure(exc)


def _covered_by_hold(generation: Generation, billed: metering.BilledUsage) -> metering.BilledUsage:
    """The part of the bill its hold pays for: all of it, unless a count below
    the serving worker's report sized the hold; then the completion and as
    much of the prompt as the hold covers (whole tokens, each part priced alike)."""
    price, held = generation.price, generation.hold_nano_usd
    if price.charge_nano_usd(billed.prompt_tokens, billed.completion_tokens) <= held:
        return billed
    completion = min(billed.completion_tokens, held // max(1, price.output_nano_usd_per_token))
    prompt = min(billed.prompt_tokens, (held - completion * price.output_nano_usd_per_token) // max(1, price.input_nano_usd_per_token))
    return billed._replace(prompt_tokens=prompt, completion_tokens=completion)


def _settlement_meta(generation: Generation, billed: metering.BilledUsage) -> dict:
    """What the read models know of a request: the first six keys since the
    first settlement; ttft_ms, stream and outcome since the activity."""
    return {"model": generation.model, "worker_id": generation.worker.id, "api_key_id": generation.grant.id,
            "prompt_tokens": billed.prompt_tokens, "completion_tokens": billed.completion_tokens,
            "started_at": generation.started_at.isoformat(),
            "ttft_ms": generation.ttft_ms, "stream": generation.streaming, "outcome": generation.outcome}


def _nothing_billed(generation: Generation) -> tuple[str, str]:
    """The status and reason of a request that ended with nothing billable."""
    if generation.outcome == CANCELLED:
        return unbilled.CANCELLED, unbilled.CALLER_LEFT
    if generation.outcome == FAILED_MID_STREAM:
        return unbilled.FAILED, unbilled.WORKER_FAILED
    return unbilled.FAILED, unbilled.EMPTY_COMPLETION


def discrepancy_of(generation: Generation, billed: metering.BilledUsage) -> tuple[cmd.RecordUsageDiscrepancy, bool]:
    """The evidence a discrepant report leaves, and whether this request alone
    proves the worker dishonest (a strike then follows without waiting for
    the same inflation across accounts)."""
    prompt_inflated = (generation.reported_prompt or 0) > generation.prompt_bound
    reason = billed.strike_reason or (registry.PROMPT_ABOVE_BOUND if prompt_inflated else registry.USAGE_ABOVE_BOUND_UNPROVEN)
    discrepancy = cmd.RecordUsageDiscrepancy(
        generation.request_id, generation.worker.id, generation.reported_prompt or 0, generation.reported_completion or 0,
        billed.prompt_tokens, billed.completion_tokens, f"usage-discrepancy:{generation.request_id}",
        generation.grant.account_id, reason,
    )
    proof = billed.strike_reason is not None and billed.strike_reason not in registry.CROSS_ACCOUNT_REASONS
    return discrepancy, proof
