"""POST /v1/embeddings (OpenAI API), for API keys: the body to the proxy's
embeddings (proxy/embeddings.py), its answer back as JSON with the request id
and the exact cost in headers, as chat answers."""
from __future__ import annotations

import orjson
from litestar import Controller, Request, post
from litestar.response.base import ASGIResponse
from litestar.types import ASGIApp

from app.http.guards import GRANT, KeyHolder, requires_api_key
from app.http.openapi import API_KEY
from app.http.plumbing import json_body
from proxy.embeddings import Embeddings


class EmbeddingsController(Controller):
    path = "/v1"
    tags = ["inference"]
    guards = [requires_api_key]
    dependencies = GRANT
    security = API_KEY

    @post("/embeddings", summary="Create embeddings (OpenAI API), billed per input token", status_code=200)
    async def create_embeddings(self, request: Request, grant: KeyHolder) -> ASGIApp:
        embedded = await Embeddings(request.app.state.proxy).create(await json_body(request), grant)
        return ASGIResponse(body=orjson.dumps(embedded.answer), media_type="application/json",
                            headers={"x-request-id": embedded.request_id, "x-paralon-cost-nano-usd": str(embedded.cost_nano_usd)})
