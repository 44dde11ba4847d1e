"""One inference request, from key to its stream (DESIGN.md, A request through the proxy).

`InferenceProxy.open` authenticates nothing (the controller did): it prices
the model, places the hold, routes, and reads the upstream stream up to its
first token, retrying other workers on a failure before it (and a worker's
own "too long" on a larger one). A prompt whose byte bound does not fit every
worker of its model is counted by a worker first (proxy/tokenize.py); short
prompts never are. It returns a
`Generation` (proxy/generation.py) whose `events()` relays the rest and hands
it to the `Settler` (proxy/settlement.py) at the end.
"""
from __future__ import annotations

import asyncio
import time

import orjson

from ledger.hold_pool import HoldPool, Reservation
from ledger.holds import HoldResult, PlaceHold
from ledger.schema import utc_now
from ledger.service import Ledger
from proxy import forwarded_fields, metering, request_checks, routing, tokenize, unbilled
from proxy import workers as registry
from proxy.directory import Directory
from proxy.errors import (
    ContextTooLong,
    InvalidRequest,
    NoWorkerAvailable,
    ProxyError,
    UnknownModel,
    UpstreamFailed,
    hold_refusal,
)
from proxy.generation import CHAT, Generation
from proxy.keys import KeyGrant
from proxy.request_ids import new_request_id
from proxy.limits import (
    HOLD_TTL_S_DEFAULT,
    SOLVENT_FOR_S,
    UNBILLED_FLUSH_INTERVAL_S,
    UPSTREAM_ATTEMPTS_MAX,
    UPSTREAM_REFUSAL_DETAIL_BYTES_MAX,
)
from proxy.withheld import WithheldJournal
from proxy.settlement import Settler, hold_key
from proxy.upstream import UpstreamError, UpstreamPool


class _Retry(Exception):
    """This worker failed before its first token: try the next one."""


class _TooLong(_Retry):
    """This worker refused the prompt as too long for its context: try a larger one."""

    def __init__(self, refusal: ContextTooLong, context_length: int | None) -> None:
        super().__init__(str(refusal))
        self.refusal, self.context_length = refusal, context_length


class InferenceProxy:
    def __init__(self, ledger: Ledger, directory: Directory, upstream: UpstreamPool, *, hold_ttl_s: int = HOLD_TTL_S_DEFAULT,
                 replica_id: str | None = None, journal: WithheldJournal | None = None, hold_pools: bool = True) -> None:
        self.ledger = ledger
        self.directory = directory
        self.upstream = upstream
        self.hold_ttl_s = hold_ttl_s
        self.replica_id = replica_id  # written on every hold this process places
        self.counter = tokenize.PromptCounter(upstream)
        # With hold pools, a request reserves from this replica's pooled hold of its customer (ledger.hold_pool).
        self.pool = HoldPool(ledger, replica_id=replica_id, ttl_s=hold_ttl_s) if hold_pools else None
        self.settler = Settler(ledger, directory, upstream, hold_ttl_s=hold_ttl_s, replica_id=replica_id, journal=journal,
                               pool=self.pool)
        self._solvent_until: dict[int, float] = {}  # account: monotonic time its last full hold vouches until

    # Before the first token
    async def open(self, kind: str, body: object, grant: KeyGrant) -> Generation:
        """Hold, route and read up to the first token. For a customer whose last
        hold here was granted in full, the upstream request starts while the
        hold is being placed, so the hold adds nothing to the first token; it
        is abandoned (nothing relayed, nothing charged) if the hold is refused."""
        opened_s = time.perf_counter()
        prepared = self._prepare(kind, body, grant)
        if prepared is None:  # a long prompt: plan on the engine's count
            prepared = self._prepare(kind, body, grant, await self._count(kind, body), counted_asked=True)
        generation, candidates, hold_request = prepared
        generation.started_s = opened_s  # its time to first token counts the counting too
        placing = self._hold(hold_request)  # queued now, not a loop turn later
        upstream_task = None
        if self._solvent_until.get(grant.account_id, 0.0) > time.monotonic():
            upstream_task = asyncio.ensure_future(self._start_upstream(generation, body, candidates))
        try:
            hold = await asyncio.shield(placing)
        except asyncio.CancelledError:  # the caller left: release the hold whenever it lands
            placing.add_done_callback(self.settler.release_when_placed)
            self.settler.unbilled.note(generation, unbilled.CANCELLED, unbilled.CALLER_LEFT)
            await self._abandon_attempt(generation, upstream_task)
            raise
        except BaseException as exc:
            self._solvent_until.pop(grant.account_id, None)
            await self._abandon_attempt(generation, upstream_task)
            refusal = hold_refusal(exc, "shorten the prompt")
            if refusal is not None:
                raise refusal from None
            raise
        asked_max_tokens = generation.max_tokens
        generation.accept_hold(hold.hold_id, hold.amount_nano_usd)
        if isinstance(hold, Reservation):
            generation.reservation = hold
        self.settler.track(generation)
        try:
            if generation.max_tokens < asked_max_tokens:  # clamped: ask again for what the hold pays for
                self._solvent_until.pop(grant.account_id, None)
                await self._abandon_attempt(generation, upstream_task)
                upstream_task = None
            else:
                self._solvent_until[grant.account_id] = time.monotonic() + SOLVENT_FOR_S
            await (upstream_task or self._start_upstream(generation, body, candidates))
        except BaseException as exc:
            self.settler.unbilled.note(generation, *unbilled.ended_by(exc))
            await self.settler.release(generation)
            raise
        return generation

    def _hold(self, request: PlaceHold) -> asyncio.Future:
        """The request's hold: a hold of its own, or a share of its customer's pooled hold."""
        if self.pool is None:
            return self.ledger.hold_placed(request)
        return asyncio.ensure_future(self._pooled_or_own(request))

    async def _pooled_or_own(self, request: PlaceHold) -> Reservation | HoldResult:
        """A share of the customer's pool; a hold of its own where no whole pool
        fits the customer's credit or the key's limit (clamped there, as ever)."""
        reservation = await self.pool.reserve(request.account_id, request.amount_nano_usd, spend_limit_id=request.spend_limit_id)
        return reservation if reservation is not None else await self.ledger.hold_placed(request)

    def _prepare(self, kind: str, body: object, grant: KeyGrant, counted: int | None = None, *,
                 counted_asked: bool = False) -> tuple[Generation, list[registry.WorkerView], PlaceHold] | None:
        """Validate, price, bound, and plan the hold: everything that needs no I/O.
        None when the byte bound does not fit every worker and the prompt is
        countable: plan again with the engine's count (`_count`), or None for
        it when no worker answered."""
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        request_checks.check_body(kind, body)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("model is required", param="model")
        price = self.directory.prices.get(model)
        fleet = registry.for_task(self.directory.fleet.get(model), registry.CHAT, model)
        if price is None or not fleet:
            raise UnknownModel(f"The model `{model}` does not exist")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise InvalidRequest("stream_options must be an object", param="stream_options")
        streaming = _flag(body, "stream", "stream")
        wants_usage = _flag(stream_options, "include_usage", "stream_options")
        wants_continuous_usage = _flag(stream_options, "continuous_usage_stats", "stream_options")
        byte_bound = metering.prompt_tokens_bound(kind, body)
        asked_max_tokens = metering.requested_max_tokens(kind, body)
        choices = metering.requested_choices(kind, body)  # each held for max_tokens
        if not counted_asked and not routing.holds_everywhere(fleet, byte_bound + (asked_max_tokens or 1)) \
                and tokenize.countable(kind, body):
            return None
        # A count comes from some worker of the model, maybe not the one that serves: it places
        # the prompt (context, room for max_tokens) and sizes the hold, so a customer is not refused
        # for four times the prompt; the bound a worker's report is billed at and judged by stays
        # the byte bound, which no worker can move (a charge never exceeds its hold).
        context_bound = tokenize.bound_in_force(byte_bound, counted)
        candidates = routing.candidates(fleet, context_bound + (asked_max_tokens or 1))
        max_tokens = metering.planned_max_tokens(asked_max_tokens, context_bound, [w.context_length for w in candidates])
        request_id = new_request_id("chatcmpl-" if kind == CHAT else "cmpl-")
        plan = metering.plan_hold(price, context_bound, max_tokens, choices)
        hold_request = PlaceHold(grant.account_id, plan.amount_nano_usd, hold_key(request_id), self.hold_ttl_s,
                                 plan.minimum_nano_usd, spend_limit_id=grant.spend_limit_id, replica_id=self.replica_id)
        generation = Generation(
            kind=kind, request_id=request_id, model=model, price=price, grant=grant, prompt_bound=byte_bound,
            context_bound=context_bound, max_tokens=max_tokens, wants_usage=wants_usage,
            wants_continuous_usage=wants_continuous_usage, started_at=utc_now(),
            streaming=streaming, settle=self.settler.settle,
            choices_per_prompt=metering.choices_per_prompt(body), choices=choices,
        )
        return generation, candidates, hold_request

    async def _count(self, kind: str, body: dict) -> int | None:
        """The prompt's tokens as a worker counts them. Before a prompt is
        refused on a count, another worker is asked: the smaller count wins, so
        one worker counting high cannot get a prompt that fits refused."""
        model, fleet = body["model"], self.directory.fleet[body["model"]]
        forwarded = forwarded_fields.upstream_fields(body)
        counted = await self.counter.count(model, kind, forwarded, fleet)
        if counted is None:
            return None
        needed = tokenize.bound_in_force(metering.prompt_tokens_bound(kind, body), counted.tokens) + 1
        if not any(w.context_length is None or w.context_length >= needed for w in fleet):
            second = await self.counter.count(model, kind, forwarded, fleet, excluding=counted.worker_id)
            if second is not None and second.tokens < counted.tokens:
                return second.tokens
        return counted.tokens

    async def _abandon_attempt(self, generation: Generation, upstream_task: asyncio.Future | None) -> None:
        """Stop a speculative upstream request, whether or not it got its first token."""
        if upstream_task is None:
            return
        upstream_task.cancel()
        await asyncio.gather(upstream_task, return_exceptions=True)
        if generation.worker is not None:  # it had finished: close what it opened
            await generation.close_upstream()
            self._forget_attempt(generation)

    async def _start_upstream(self, generation: Generation, body: dict, candidates: list[registry.WorkerView]) -> None:
        last_error: Exception | None = None
        too_long: _TooLong | None = None  # the last worker's own "too long": only larger ones are tried after it
        forwarded = self._forwarded_fields(body)  # once per request, whichever worker answers
        attempts = 0
        # Only a choice between workers reads the key: a single one takes every request.
        key = self._affinity_key(generation.model, body) if len(candidates) > 1 else b""
        for worker in self.directory.place(generation.model, key, candidates, generation.context_bound or generation.prompt_bound):
            if attempts == UPSTREAM_ATTEMPTS_MAX:
                break
            if too_long is not None and not routing.larger(worker, too_long.context_length):
                continue
            attempts += 1
            try:
                await self._try_worker(generation, forwarded, worker)
                return
            except _Retry as exc:
                last_error = exc
                if isinstance(exc, _TooLong):
                    too_long = exc
                    self.counter.distrust(generation.model, generation.kind, forwarded)
                await generation.close_upstream()
                self._forget_attempt(generation)
            except BaseException:
                await generation.close_upstream()
                self._forget_attempt(generation)
                raise
        if too_long is not None and last_error is too_long:  # no larger worker left: the caller's prompt is too long
            raise too_long.refusal
        raise NoWorkerAvailable(f"every worker tried failed before its first token ({last_error})")

    def _affinity_key(self, model: str, body: dict) -> bytes:
        return routing.affinity_key(model, body)

    def _forget_attempt(self, generation: Generation) -> None:
        worker = generation.forget_attempt()
        load = self.directory.loads.get(worker.id) if worker else None
        if load is not None:
            load.in_flight -= 1

    def _forwarded_fields(self, body: dict) -> dict:
        return forwarded_fields.upstream_fields(body)

    def _upstream_body(self, generation: Generation, forwarded: dict, worker: registry.WorkerView) -> dict:
        return {
            **forwarded, "model": worker.served_model or worker.model, "stream": True,
            "max_tokens": routing.worker_max_tokens(generation.max_tokens, generation.context_bound or generation.prompt_bound,
                                                worker.context_length),
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }

    async def _try_worker(self, generation: Generation, forwarded: dict, worker: registry.WorkerView) -> None:
        upstream_body = self._upstream_body(generation, forwarded, worker)
        generation.use_worker(worker, upstream_body)
        self.directory.loads[worker.id].in_flight += 1
        try:
            generation.attach(await self.upstream.post(generation.upstream_url(), orjson.dumps(upstream_body)))
        except UpstreamError as exc:
            raise _Retry(f"worker {worker.id}: {exc}") from None
        status = generation.response.status
        if status != 200:
            detail = (await generation.response.read())[:UPSTREAM_REFUSAL_DETAIL_BYTES_MAX]
            if status == 400:
                refusal = _upstream_refusal(detail)
                if isinstance(refusal, ContextTooLong):
                    raise _TooLong(refusal, worker.context_length)
                raise refusal
            raise _Retry(f"worker {worker.id} answered {status}")
        try:
            if await generation.read_to_first_token():
                return
        except (UpstreamError, UpstreamFailed, ValueError) as exc:
            raise _Retry(f"worker {worker.id}: {exc}") from None
        raise _Retry(f"worker {worker.id} closed the stream before its first token")

    # While requests run, and at shutdown
    async def keep_holds(self) -> None:
        await self.settler.keep_holds()

    async def record_unbilled(self) -> None:
        """Write the requests that ended with nothing charged, once a second."""
        await self.settler.unbilled.run(UNBILLED_FLUSH_INTERVAL_S)

    async def drain_background(self) -> None:
        await self.settler.drain_background()


def _upstream_refusal(detail: bytes) -> ProxyError:
    """A worker's 400 is the caller's problem (usually a prompt too long for it)."""
    try:
        message = orjson.loads(detail).get("message") or orjson.loads(detail)["error"]["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = detail.decode(errors="replace")
    if "context" in message.lower():
        return ContextTooLong(message, param="messages")
    return InvalidRequest(message)


def _flag(fields: dict, name: str, param: str) -> bool:
    """A JSON boolean, absent or null meaning false: the string "false" is not false."""
    value = fields.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false", param=param)
    return bool(value)
