"""The OpenAI API in front of the workers, for API keys (`Authorization:
Bearer sk-par-…`). Controllers translate HTTP to a proxy call; the proxy's
typed errors become OpenAI's error JSON (app/http/errors.py)."""
from __future__ import annotations

from typing import Annotated

import orjson
from litestar import Controller, Request, Response, get, post
from litestar.config.cors import CORSConfig
from litestar.params import PathParameter
from litestar.response.base import ASGIResponse
from litestar.types import ASGIApp

from app.http.errors import UnknownGeneration
from app.http.guards import GRANT, KeyHolder, requires_api_key
from app.http.openapi import API_KEY
from app.http.plumbing import PathName, json_body, json_response, path_name, read
from app.http.relay_response import RelayResponse
from app.settings import Settings
from ledger.money import nano_usd_to_usd_text
from proxy.directory import Directory
from proxy.errors import UnknownModel
from proxy.generation import CHAT, COMPLETIONS
from proxy.generations import find_generation
from proxy.keys import KeyGrant
from proxy.prices import TOKENS_PER_MTOK
from proxy.service import InferenceProxy
from proxy.workers import WorkerView


class InferenceController(Controller):
    path = "/v1"
    tags = ["inference"]
    guards = [requires_api_key]
    security = API_KEY
    dependencies = GRANT

    @post("/chat/completions", summary="Create a chat completion (OpenAI API)", status_code=200)
    async def chat_completions(self, request: Request, grant: KeyHolder) -> ASGIApp:
        return await complete(request.app.state.proxy, CHAT, await json_body(request), grant)

    @post("/completions", summary="Create a completion (OpenAI API)", status_code=200)
    async def completions(self, request: Request, grant: KeyHolder) -> ASGIApp:
        return await complete(request.app.state.proxy, COMPLETIONS, await json_body(request), grant)

    @get("/models", summary="Models that can answer now, with their prices and context length (OpenAI API)")
    async def list_models(self, request: Request) -> Response:
        directory: Directory = request.app.state.directory
        data = [_model_entry(directory, model) for model in directory.models() if _live_workers(directory, model)]
        return json_response({"object": "list", "data": data})

    @get("/models/{model:path}", summary="One model, as listed (OpenAI API)")
    async def get_model(self, request: Request, model: Annotated[str, PathParameter()]) -> Response:
        directory: Directory = request.app.state.directory
        name = model.removeprefix("/")  # a model's name may hold slashes (org/name), so the rest of the path is it
        if name not in directory.models() or not _live_workers(directory, name):
            raise UnknownModel(f"The model `{name}` does not exist or has no worker serving it", param="model")
        return json_response(_model_entry(directory, name))

    @get("/generations/{request_id:str}", summary="The recorded charge of one request")
    async def get_generation(self, request: Request, grant: KeyHolder, request_id: PathName) -> Response:
        found = await read(request, find_generation, path_name(request_id, "request_id"), grant.account_id)
        if found is None:
            raise UnknownGeneration(f"no settled request {request_id!r} for this key's account")
        return json_response(found)


async def complete(proxy: InferenceProxy, kind: str, body: object, grant: KeyGrant) -> ASGIApp:
    """The answer to a completion request (`kind`), as an ASGI app: a stream
    relayed as it comes, or the whole answer with its cost."""
    generation = await proxy.open(kind, body, grant)
    if body.get("stream"):
        return RelayResponse(generation)
    answer = await generation.collect()
    return ASGIResponse(body=orjson.dumps(answer), media_type="application/json",
                        headers={"x-request-id": generation.request_id, "x-paralon-cost-nano-usd": str(generation.cost_nano_usd)})


def _live_workers(directory: Directory, model: str) -> list[WorkerView]:
    """Workers that may take a request now: healthy, neither draining, drained nor suspended."""
    return [w for w in directory.fleet.get(model, ()) if w.state == "active" and w.healthy]


def _model_entry(directory: Directory, model: str) -> dict:
    price = directory.prices[model]
    contexts = [w.context_length for w in _live_workers(directory, model) if w.context_length]
    return {
        "id": model, "object": "model", "created": 0, "owned_by": "paralon",
        "context_length": max(contexts) if contexts else None,
        "pricing": {
            "input_nano_usd_per_token": price.input_nano_usd_per_token,
            "output_nano_usd_per_token": price.output_nano_usd_per_token,
            "input_usd_per_mtok": nano_usd_to_usd_text(price.input_nano_usd_per_token * TOKENS_PER_MTOK),
            "output_usd_per_mtok": nano_usd_to_usd_text(price.output_nano_usd_per_token * TOKENS_PER_MTOK),
        },
    }


# What a page's script may read of an answer besides its body: the request's id
# and cost, and whether to retry.
EXPOSED_HEADERS = ["x-request-id", "x-paralon-cost-nano-usd", "retry-after", "x-should-retry"]


def browser_cors(settings: Settings) -> CORSConfig | None:
    """CORS for the origins PARALON_CORS_ORIGINS names; None (off) when it names none."""
    origins = settings.proxy.cors_origins
    if not origins:
        return None
    # Any request header (the SDKs send their own x-stainless-*); bearer keys, never cookies, so no credentials.
    return CORSConfig(allow_origins=list(origins), allow_headers=["*"], allow_credentials=False,
                      expose_headers=EXPOSED_HEADERS)
