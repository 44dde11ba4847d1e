"""One inference request, from key to settlement (DESIGN.md, A request through the proxy).

`InferenceProxy.open` authenticates nothing (the controller did), prices the
model, places the hold, routes, and reads the upstream stream up to its first
token, retrying other workers on a failure before it; it returns a
`Generation` whose `events()` relays the rest and settles at the end.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import orjson

from ledger import commands as cmd
from ledger.errors import HoldNotActive, IdempotencyConflict, InsufficientFunds, LedgerError, SpendLimitReached, WriterOverloaded
from ledger.holds import HoldRenewal, PlaceHold, settlement_key
from ledger.schema import utc_now
from ledger.service import Ledger
from proxy import forwarded_fields, generations, metering, routing, sse
from proxy import workers as registry
from proxy.directory import Directory
from proxy.errors import (
    ContextTooLong,
    InvalidRequest,
    LimitReached,
    NoWorkerAvailable,
    NotEnoughCredits,
    ProxyError,
    UnknownModel,
    UpstreamFailed,
)
from proxy.keys import KeyGrant
from proxy.generation import CHAT, COMPLETIONS, Generation
from proxy.upstream import UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

# Short, because requests still running renew their holds: after a crash the
# customer's credits come back (or settle) within about this long.
HOLD_TTL_S = 60
# How often a process renews the holds of its requests still running and
# records what each has delivered: one statement for all of them (at most a
# quarter of the TTL, so a renewal can be late without losing a hold).
HOLD_RENEW_INTERVAL_S_MAX = 1.0
UPSTREAM_ATTEMPTS_MAX = 3
USAGE_PROBE_TIMEOUT_S = 30.0
# How long a hold granted in full lets the next request of the same customer
# start upstream before its own hold is confirmed.
SOLVENT_FOR_S = 30.0
SETTLE_ATTEMPTS_MAX = 5
SETTLE_RETRY_WAIT_S = 0.05
# max_tokens when the caller set none and no candidate has told its context length yet
MAX_TOKENS_WITHOUT_CONTEXT = 4096
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


class _Retry(Exception):
    """This worker failed before its first token: try the next one."""


class InferenceProxy:
    def __init__(self, ledger: Ledger, directory: Directory, upstream: UpstreamPool, *, hold_ttl_s: int = HOLD_TTL_S) -> None:
        self.ledger = ledger
        self.directory = directory
        self.upstream = upstream
        self.hold_ttl_s = hold_ttl_s
        self._background: set[asyncio.Task] = set()
        self._solvent_until: dict[int, float] = {}  # account: monotonic time its last full hold vouches until
        self._live: dict[int, Generation] = {}  # hold id: its request, until it settles or releases

    # Before the first token
    async def open(self, kind: str, body: object, grant: KeyGrant) -> Generation:
        """Hold, route and read up to the first token. For a customer whose last
        hold here was granted in full, the upstream request starts while the
        hold is being placed, so the hold adds nothing to the first token; it
        is abandoned (nothing relayed, nothing charged) if the hold is refused."""
        generation, candidates, hold_request = self._prepare(kind, body, grant)
        hold_task = asyncio.ensure_future(self.ledger.place_hold_async(hold_request))
        upstream_task = None
        if self._solvent_until.get(grant.account_id, 0.0) > time.monotonic():
            upstream_task = asyncio.ensure_future(self._start_upstream(generation, body, candidates))
        try:
            hold = await asyncio.shield(hold_task)
        except asyncio.CancelledError:  # the caller left: release the hold whenever it lands
            hold_task.add_done_callback(self._release_when_placed)
            await self._abandon_attempt(generation, upstream_task)
            raise
        except BaseException as exc:
            self._solvent_until.pop(grant.account_id, None)
            await self._abandon_attempt(generation, upstream_task)
            if isinstance(exc, InsufficientFunds):
                raise NotEnoughCredits("not enough credits for this request: add credits or shorten the prompt") from None
            if isinstance(exc, SpendLimitReached):
                raise LimitReached("this API key has reached its spend limit") from None
            raise
        asked_max_tokens = generation.max_tokens
        self._accept_hold(generation, hold)
        try:
            if generation.max_tokens < asked_max_tokens:  # clamped: ask again for what the hold pays for
                self._solvent_until.pop(grant.account_id, None)
                await self._abandon_attempt(generation, upstream_task)
                upstream_task = None
            else:
                self._solvent_until[grant.account_id] = time.monotonic() + SOLVENT_FOR_S
            await (upstream_task or self._start_upstream(generation, body, candidates))
        except BaseException:
            await self._release(generation)
            raise
        return generation

    def _prepare(self, kind: str, body: object, grant: KeyGrant) -> tuple[Generation, list[registry.WorkerView], PlaceHold]:
        """Validate, price, bound, and plan the hold: everything that needs no I/O."""
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("model is required", param="model")
        price = self.directory.prices.get(model)
        fleet = self.directory.fleet.get(model)
        if price is None or not fleet:
            raise UnknownModel(f"The model `{model}` does not exist")
        if body.get("n", 1) != 1:
            raise InvalidRequest("n must be 1", param="n")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise InvalidRequest("stream_options must be an object", param="stream_options")
        prompt_bound = metering.prompt_tokens_bound(kind, body)
        asked_max_tokens = metering.requested_max_tokens(kind, body)
        candidates = self._candidates(fleet, prompt_bound + (asked_max_tokens or 1))
        known_contexts = [w.context_length for w in candidates if w.context_length]
        room = max(max(known_contexts) - prompt_bound, 1) if known_contexts else MAX_TOKENS_WITHOUT_CONTEXT
        max_tokens = asked_max_tokens or room
        if len(known_contexts) == len(candidates):
            max_tokens = min(max_tokens, room)
        request_id = ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex
        plan = metering.plan_hold(price, prompt_bound, max_tokens)
        hold_request = PlaceHold(grant.account_id, plan.amount_nano_usd, f"hold:{request_id}", self.hold_ttl_s,
                                 plan.minimum_nano_usd, spend_limit_id=grant.spend_limit_id)
        generation = Generation(
            proxy=self, kind=kind, request_id=request_id, model=model, price=price, grant=grant, hold_id=0,
            hold_nano_usd=0, prompt_bound=prompt_bound, max_tokens=max_tokens,
            wants_usage=bool(stream_options.get("include_usage")),
            wants_continuous_usage=bool(stream_options.get("continuous_usage_stats")), started_at=utc_now(),
            streaming=bool(body.get("stream")),
        )
        return generation, candidates, hold_request

    def _accept_hold(self, generation: Generation, hold) -> None:
        generation.hold_id, generation.hold_nano_usd = hold.hold_id, hold.amount_nano_usd
        generation.max_tokens = min(generation.max_tokens, metering.affordable_max_tokens(
            generation.price, generation.prompt_bound, hold.amount_nano_usd))
        self._live[hold.hold_id] = generation

    async def _abandon_attempt(self, generation: Generation, upstream_task: asyncio.Future | None) -> None:
        """Stop a speculative upstream request, whether or not it got its first token."""
        if upstream_task is None:
            return
        upstream_task.cancel()
        await asyncio.gather(upstream_task, return_exceptions=True)
        if generation.worker is not None:  # it had finished: close what it opened
            await generation.close_upstream()
            self._forget_attempt(generation)

    def _release_when_placed(self, hold_task: asyncio.Future) -> None:
        if not hold_task.cancelled() and hold_task.exception() is None:
            self._in_background(asyncio.to_thread(self.ledger.release_hold, hold_task.result().hold_id))

    def _candidates(self, fleet: list[registry.WorkerView], tokens_needed: int) -> list[registry.WorkerView]:
        routable = [w for w in fleet if w.state == "active" and w.healthy]
        if not routable:
            raise NoWorkerAvailable("no worker is available for this model right now")
        fits = [w for w in routable if w.context_length is None or w.context_length >= tokens_needed]
        if not fits:
            largest = max(w.context_length for w in routable)
            raise ContextTooLong(
                f"This model's maximum context length is {largest} tokens; the request may need up to {tokens_needed}",
                param="messages",
            )
        return fits

    def _route(self, body: dict, model: str, fleet: list[registry.WorkerView]) -> list[registry.WorkerView]:
        measured = {w.id: self.directory.measured_tokens_per_s(w) for w in fleet}
        sizes = routing.weights(measured)
        candidates = [
            routing.Candidate(w.id, sizes[w.id][0], sizes[w.id][1], self.directory.loads[w.id].busy()) for w in fleet
        ]
        by_id = {w.id: w for w in fleet}
        return [by_id[c.worker_id] for c in routing.choose(routing.affinity_key(model, body), candidates)]

    async def _start_upstream(self, generation: Generation, body: dict, candidates: list[registry.WorkerView]) -> None:
        last_error: Exception | None = None
        forwarded = forwarded_fields.upstream_fields(body)  # once per request, whichever worker answers
        for worker in self._route(body, generation.model, candidates)[:UPSTREAM_ATTEMPTS_MAX]:
            try:
                await self._try_worker(generation, forwarded, worker)
                return
            except _Retry as exc:
                last_error = exc
                await generation.close_upstream()
                self._forget_attempt(generation)
            except BaseException:
                await generation.close_upstream()
                self._forget_attempt(generation)
                raise
        raise NoWorkerAvailable(f"every worker tried failed before its first token ({last_error})")

    def _forget_attempt(self, generation: Generation) -> None:
        load = self.directory.loads.get(generation.worker.id) if generation.worker else None
        if load is not None:
            load.in_flight -= 1
        generation.worker, generation.response, generation.upstream = None, None, None
        generation.pending = []
        generation.forget_output()
        generation.first_token_at, generation.upstream_done = 0.0, False

    async def _try_worker(self, generation: Generation, forwarded: dict, worker: registry.WorkerView) -> None:
        upstream_body = {
            **forwarded, "model": worker.served_model or worker.model, "stream": True, "max_tokens": generation.max_tokens,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        generation.use_worker(worker, upstream_body)
        self.directory.loads[worker.id].in_flight += 1
        try:
            generation.response = await self.upstream.post(worker.url + PATHS[generation.kind], orjson.dumps(upstream_body))
        except UpstreamError as exc:
            raise _Retry(f"worker {worker.id}: {exc}") from None
        status = generation.response.status
        if status != 200:
            detail = (await generation.response.read())[:2000]
            if status == 400:
                raise _upstream_refusal(detail)
            raise _Retry(f"worker {worker.id} answered {status}")
        generation.upstream = sse.data_events(generation.response.pieces())
        try:
            async for data in generation.upstream:
                if data == sse.DONE:
                    generation.upstream_done = True
                    return
                out = generation.transform(data)
                if out is not None:
                    generation.pending.append(out)
                if generation.counted_tokens:
                    return
        except (UpstreamError, UpstreamFailed, ValueError) as exc:
            raise _Retry(f"worker {worker.id}: {exc}") from None
        raise _Retry(f"worker {worker.id} closed the stream before its first token")

    # After the last token
    async def finish(self, generation: Generation) -> None:
        """Settle what was delivered, durably, then the response may end."""
        if generation.finished:
            return
        generation.finished = True
        load = self.directory.loads.get(generation.worker.id)
        if load is not None:
            load.in_flight -= 1
            decode_s = time.perf_counter() - generation.first_token_at if generation.first_token_at else 0.0
            load.observe(generation.counted_tokens, decode_s, load.busy() + 1)
        if generation.reported_prompt is None and generation.counted_tokens:
            await self._ask_prompt_tokens(generation)
        billed = generation.delivered_usage()
        generation.usage = {"prompt_tokens": billed.prompt_tokens, "completion_tokens": billed.completion_tokens,
                            "total_tokens": billed.prompt_tokens + billed.completion_tokens}
        if billed.completion_tokens == 0:  # an empty completion costs nothing
            await self._release(generation)
            return
        generation.cost_nano_usd = generation.price.charge_nano_usd(billed.prompt_tokens, billed.completion_tokens)
        try:
            await self._settle_delivered(generation, billed)
        except Exception:  # a refusal, or the database away: the charge is not lost either way
            await self._settle_later(generation, billed)
        finally:
            self._live.pop(generation.hold_id, None)
        if billed.discrepant:  # evidence is recorded off the path to [DONE]
            self._in_background(self._record_discrepancy(generation, billed))

    async def _settle_later(self, generation: Generation, billed: metering.BilledUsage) -> None:
        """The settlement could not be written (the database or the writer is
        away). Delivered tokens are never given away: a streaming caller has
        them, so the hold keeps the full charge as its recorded usage and the
        sweeper settles it once it expires. A non-streaming caller has received
        nothing: the hold is released and the answer withheld."""
        if not generation.streaming:
            log.exception("request %s could not be settled; nothing was delivered, its hold is released", generation.request_id)
            generation.cost_nano_usd, generation.settle_failed = 0, True
            await self._release(generation)
            return
        log.exception("request %s could not be settled now; the sweeper settles its hold", generation.request_id)
        final = self._renewal(generation, billed)
        try:
            await asyncio.shield(asyncio.to_thread(self.ledger.renew_holds, [final]))
        except Exception:  # the hold keeps the usage recorded at the last renewal
            log.warning("request %s: its hold keeps the usage last recorded", generation.request_id, exc_info=True)

    def _settlement_meta(self, generation: Generation, billed: metering.BilledUsage) -> dict:
        return {"model": generation.model, "worker_id": generation.worker.id, "api_key_id": generation.grant.id,
                "prompt_tokens": billed.prompt_tokens, "completion_tokens": billed.completion_tokens,
                "started_at": generation.started_at.isoformat()}

    async def _settle_delivered(self, generation: Generation, billed: metering.BilledUsage) -> None:
        """Charge the hold. A settlement never depends on its hold still being
        there: if the sweeper closed it (this process could not renew it in
        time), it settled what was recorded as delivered, and the rest is
        charged now, under a hold of its own."""
        meta = self._settlement_meta(generation, billed)
        try:
            await self._append(cmd.SettleRequest(generation.hold_id, generation.worker.owner_account_id, generation.cost_nano_usd,
                                                 generation.request_id, settlement_key(generation.request_id), meta))
        except (HoldNotActive, IdempotencyConflict):
            await self._settle_rest(generation, meta)

    async def _settle_rest(self, generation: Generation, meta: dict) -> None:
        rid, grant = generation.request_id, generation.grant
        first = await asyncio.to_thread(self._settled, rid)
        charged = first.charge_nano_usd if first else 0
        rest = generation.cost_nano_usd - charged
        generation.cost_nano_usd = charged
        if rest <= 0:
            return
        rest_meta = {**meta, "prompt_tokens": meta["prompt_tokens"] - (first.prompt_tokens if first else 0),
                     "completion_tokens": meta["completion_tokens"] - (first.completion_tokens if first else 0)}
        try:
            hold = await self.ledger.place_hold_async(PlaceHold(
                grant.account_id, rest, f"hold:{rid}:rest", self.hold_ttl_s, minimum_nano_usd=1,
                spend_limit_id=grant.spend_limit_id))
        except (InsufficientFunds, SpendLimitReached):
            log.warning("request %s: %s nano-USD delivered after its hold closed are not covered any more", rid, rest)
            return
        try:
            await self._append(cmd.SettleRequest(hold.hold_id, generation.worker.owner_account_id, hold.amount_nano_usd, rid,
                                                 f"{settlement_key(rid)}:rest", rest_meta))
        except LedgerError:
            await asyncio.to_thread(self.ledger.release_hold, hold.hold_id)
            raise
        generation.cost_nano_usd = charged + hold.amount_nano_usd

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

    # While requests run
    async def keep_holds(self) -> None:
        """Renew the holds of every request still running, and record what each
        stream has delivered, in one write per interval: a long request never
        outlives its hold, and after a crash the sweeper settles each hold at
        what its caller had received."""
        interval_s = min(HOLD_RENEW_INTERVAL_S_MAX, self.hold_ttl_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            renewals = [self._renewal(g) for g in list(self._live.values()) if not g.finished]
            if not renewals:
                continue
            try:
                active = await asyncio.to_thread(self.ledger.renew_holds, renewals)
            except Exception:  # the database is away: try again next round; settlement does not need the hold
                log.warning("could not renew %d hold(s)", len(renewals), exc_info=True)
                continue
            for renewal in renewals:
                if renewal.hold_id not in active:  # the sweeper took it: stop, and charge the rest at the end
                    lost = self._live.pop(renewal.hold_id, None)
                    if lost is not None:
                        lost.hold_lost = True

    def _renewal(self, generation: Generation, billed: metering.BilledUsage | None = None) -> HoldRenewal:
        """What a stream's caller has received is delivered; a non-streaming
        caller has received nothing until the answer is complete. The usage is
        written only when it changed; a prompt the worker has not reported yet
        (llama.cpp) is not charged on a crash rather than charged at its bound."""
        renewal = HoldRenewal(generation.hold_id, self.hold_ttl_s)
        if not (generation.streaming and generation.worker is not None and generation.counted_tokens):
            return renewal
        billed = billed or generation.delivered_usage()
        if generation.reported_prompt is None:
            billed = billed._replace(prompt_tokens=0)
        capture = min(generation.price.charge_nano_usd(billed.prompt_tokens, billed.completion_tokens), generation.hold_nano_usd)
        if capture == generation.recorded_capture_nano_usd:
            return renewal
        generation.recorded_capture_nano_usd = capture
        return renewal._replace(capture_nano_usd=capture, owner_account_id=generation.worker.owner_account_id,
                                request_id=generation.request_id, meta=self._settlement_meta(generation, billed))

    def _in_background(self, work) -> asyncio.Task:
        """A task nothing the caller does can cancel, awaited at shutdown."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

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
                response = await self.upstream.post(generation.worker.url + PATHS[generation.kind], orjson.dumps(body))
                prompt_tokens = orjson.loads(await response.read())["usage"]["prompt_tokens"]
        except (UpstreamError, ValueError, KeyError, TypeError, TimeoutError):
            return
        finally:
            if response is not None:
                response.close()
        if type(prompt_tokens) is int and prompt_tokens >= 0:
            generation.reported_prompt = prompt_tokens

    async def _record_discrepancy(self, generation: Generation, billed: metering.BilledUsage) -> None:
        """Every discrepancy is recorded; a strike follows only from proof on
        this request, or from the same inflation across accounts (proxy/workers.py)."""
        prompt_inflated = (generation.reported_prompt or 0) > generation.prompt_bound
        reason = billed.strike_reason or (registry.PROMPT_ABOVE_BOUND if prompt_inflated else registry.USAGE_ABOVE_BOUND_UNPROVEN)
        discrepancy = cmd.RecordUsageDiscrepancy(
            generation.request_id, generation.worker.id, generation.reported_prompt or 0, generation.reported_completion or 0,
            billed.prompt_tokens, billed.completion_tokens, f"usage-discrepancy:{generation.request_id}",
            generation.grant.account_id, reason,
        )
        proof = billed.strike_reason is not None and billed.strike_reason not in registry.CROSS_ACCOUNT_REASONS
        try:
            await asyncio.to_thread(self._strike, discrepancy, proof)
        except Exception:  # the charge is settled already; the evidence is what is lost
            log.exception("the usage discrepancy of request %s could not be recorded", generation.request_id)

    def _strike(self, discrepancy: cmd.RecordUsageDiscrepancy, proof: bool) -> None:
        with self.ledger.engine.begin() as conn:
            registry.record_usage_discrepancy(conn, discrepancy, proof=proof)

    def settle(self, generation: Generation, *, charge: bool = True) -> asyncio.Task:
        """Settle once, in a task of its own (nothing the caller does can cancel
        it): bill what was delivered, or, with charge=False (a non-streaming
        caller whose worker failed has received nothing), release the hold."""
        if generation.settling is None:
            generation.settling = self._in_background(self.finish(generation) if charge else self.abandon(generation))
        return generation.settling

    async def abandon(self, generation: Generation) -> None:
        if generation.finished:
            return
        generation.finished = True
        if generation.worker is not None:
            self.directory.loads[generation.worker.id].in_flight -= 1
        await self._release(generation)

    async def _release(self, generation: Generation) -> None:
        self._live.pop(generation.hold_id, None)
        # Shielded: a caller leaving must not stop the release once it is due.
        await asyncio.shield(asyncio.to_thread(self.ledger.release_hold, generation.hold_id))

    async def drain_background(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


def _upstream_refusal(detail: bytes) -> ProxyError:
    """A worker's 400 is the caller's problem (usually a prompt too long for it)."""
    try:
        message = orjson.loads(detail).get("message") or orjson.loads(detail)["error"]["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = detail.decode(errors="replace")
    if "context" in message.lower():
        return ContextTooLong(message, param="messages")
    return InvalidRequest(message)
