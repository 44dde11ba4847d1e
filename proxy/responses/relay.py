"""The inference proxy, able to open Responses requests as well.

A Responses request goes the way a chat request does (InferenceProxy.open:
bound, hold, route, read to the first output, retry another worker before
it); what differs is read here: the body (request.py), the stream
(stream.py), and a follow-up's earlier turns, read from the store before
anything is held, so that an unknown or another account's
`previous_response_id` is a 404 that costs nothing."""
from __future__ import annotations

import asyncio

from ledger.holds import PlaceHold
from ledger.schema import utc_now
from proxy import metering, routing
from proxy import workers as registry
from proxy.errors import InvalidRequest, ProxyError, UnknownModel
from proxy.generation import Generation
from proxy.keys import KeyGrant
from proxy.request_ids import new_request_id
from proxy.responses import store
from proxy.responses.request import RESPONSES, ResponsesRequest, read_request
from proxy.responses.stream import ResponsesGeneration
from proxy.service import InferenceProxy
from proxy.settlement import hold_key


class UnknownResponse(ProxyError):
    status, error_type, code = 404, "invalid_request_error", "response_not_found"
    param = "previous_response_id"


class ResponsesProxy(InferenceProxy):
    async def open_response(self, body: object, grant: KeyGrant) -> ResponsesGeneration:
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        history = await self._history(body.get("previous_response_id"), grant.account_id)
        return await self.open(RESPONSES, read_request(body, history), grant)

    async def _history(self, previous: object, account_id: int) -> list[dict]:
        if previous is None:
            return []
        if not isinstance(previous, str) or not previous:
            raise InvalidRequest("previous_response_id must be a string", param="previous_response_id")
        found = await asyncio.to_thread(store.conversation, self.ledger.engine, previous, account_id)
        if found is None:
            raise UnknownResponse(f"no response {previous!r} for this key's account")
        return found

    # The hooks of InferenceProxy, for a Responses request
    def _prepare(self, kind: str, body: object, grant: KeyGrant, counted: int | None = None, *,
                 counted_asked: bool = False) -> tuple[Generation, list[registry.WorkerView], PlaceHold] | None:
        if kind != RESPONSES:
            return super()._prepare(kind, body, grant, counted, counted_asked=counted_asked)
        request: ResponsesRequest = body
        price = self.directory.prices.get(request.model)
        fleet = registry.for_task(self.directory.fleet.get(request.model), registry.CHAT, request.model)
        if price is None or not fleet:
            raise UnknownModel(f"The model `{request.model}` does not exist")
        candidates = routing.candidates(fleet, request.prompt_bound + (request.max_output_tokens or 1))
        max_tokens = metering.planned_max_tokens(request.max_output_tokens, request.prompt_bound,
                                                 [w.context_length for w in candidates])
        request_id = new_request_id("resp_")
        plan = metering.plan_hold(price, request.prompt_bound, max_tokens)
        hold_request = PlaceHold(grant.account_id, plan.amount_nano_usd, hold_key(request_id), self.hold_ttl_s,
                                 plan.minimum_nano_usd, spend_limit_id=grant.spend_limit_id, replica_id=self.replica_id)
        generation = ResponsesGeneration(
            kind=RESPONSES, request_id=request_id, model=request.model, price=price, grant=grant,
            prompt_bound=request.prompt_bound, max_tokens=max_tokens, wants_usage=True, wants_continuous_usage=False,
            started_at=utc_now(), streaming=request.streaming, settle=self.settler.settle, request=request, keep=self._keep,
        )
        return generation, candidates, hold_request

    def _affinity_key(self, model: str, body: object) -> bytes:
        return super()._affinity_key(model, body.chat_view if isinstance(body, ResponsesRequest) else body)

    def _forwarded_fields(self, body: object) -> dict:
        return body.upstream_fields if isinstance(body, ResponsesRequest) else super()._forwarded_fields(body)

    def _upstream_body(self, generation: Generation, forwarded: dict, worker: registry.WorkerView) -> dict:
        if generation.kind != RESPONSES:
            return super()._upstream_body(generation, forwarded, worker)
        # Workers share no state: each request carries its whole input, and none keeps it.
        return {**forwarded, "model": worker.served_model or worker.model, "stream": True, "store": False,
                "max_output_tokens": generation.max_tokens}

    async def _keep(self, generation: ResponsesGeneration) -> None:
        await asyncio.to_thread(store.save, self.ledger.engine, generation.request_id, generation.grant.account_id,
                                generation.model, generation.request.input_items, generation.output_items())
