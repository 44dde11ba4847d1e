"""The Responses API (`POST /v1/responses`) in front of the workers, for API
keys: streamed as `response.*` events, or one response object, billed as chat
is (proxy/responses/)."""
from __future__ import annotations

import orjson
from litestar import Controller, Request, post
from litestar.response.base import ASGIResponse
from litestar.types import ASGIApp

from app.http.guards import GRANT, KeyHolder, requires_api_key
from app.http.openapi import API_KEY
from app.http.plumbing import json_body
from app.http.relay_response import RelayResponse
from proxy.responses.relay import ResponsesProxy


class ResponsesController(Controller):
    path = "/v1"
    tags = ["inference"]
    guards = [requires_api_key]
    dependencies = GRANT
    security = API_KEY

    @post("/responses", summary="Create a model response (OpenAI Responses API)", status_code=200)
    async def create_response(self, request: Request, grant: KeyHolder) -> ASGIApp:
        proxy: ResponsesProxy = request.app.state.proxy
        generation = await proxy.open_response(await json_body(request), grant)
        if generation.streaming:
            return RelayResponse(generation)
        answer = await generation.collect()
        return ASGIResponse(body=orjson.dumps(answer), media_type="application/json",
                            headers={"x-request-id": generation.request_id,
                                     "x-paralon-cost-nano-usd": str(generation.cost_nano_usd)})
