"""The HTTP service: the OpenAI API in front of the workers.

Controllers translate HTTP to a proxy call and typed errors to OpenAI's error
JSON; they hold no business rules."""
from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager

import httpx
import orjson
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.response.base import ASGIResponse
from litestar.static_files import create_static_files_router
from litestar.types import ASGIApp
from swagger_ui_bundle import swagger_ui_path

from app.http.management import MANAGEMENT_HANDLERS
from app.http.relay_response import RelayResponse
from app.http.webhooks import stripe_webhook
from ledger.db import is_postgres
from ledger.money import nano_usd_to_usd_text
from ledger.service import Ledger
from proxy.directory import Directory
from proxy.errors import AuthenticationFailed, InvalidRequest, ProxyError, UnknownGeneration, error_body
from proxy.generations import find_generation
from proxy.health import HealthChecker
from proxy.keys import KeyGrant
from proxy.prices import TOKENS_PER_MTOK
from proxy.generation import CHAT, COMPLETIONS
from proxy.revocations import follow_revocations
from proxy.limits import HOLD_TTL_S
from proxy.service import InferenceProxy
from proxy.upstream import UpstreamPool

UPSTREAM_CONNECTIONS_MAX = 1024
HOLD_SWEEP_INTERVAL_S = 10.0


def _json(data: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


def _proxy_error(_: Request, exc: ProxyError) -> Response:
    headers = {"retry-after": str(exc.retry_after_s)} if exc.retry_after_s else None
    return _json(error_body(exc), exc.status, headers)


def _http_error(_: Request, exc: HTTPException) -> Response:
    error_type = "invalid_request_error" if exc.status_code < 500 else "api_error"
    return _json({"error": {"message": str(exc.detail), "type": error_type, "param": None, "code": None}}, exc.status_code)


async def _grant(request: Request) -> KeyGrant:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthenticationFailed("missing API key: send Authorization: Bearer sk-…")
    grant = await request.app.state.directory.authenticate(key.strip())
    if grant is None:
        raise AuthenticationFailed("invalid or revoked API key")
    return grant


async def _body(request: Request) -> object:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None


async def _complete(request: Request, kind: str) -> ASGIApp:
    grant = await _grant(request)
    body = await _body(request)
    proxy: InferenceProxy = request.app.state.proxy
    generation = await proxy.open(kind, body, grant)
    if body.get("stream"):
        return RelayResponse(generation)
    answer = await generation.collect()
    return ASGIResponse(body=orjson.dumps(answer), media_type="application/json",
                        headers={"x-request-id": generation.request_id, "x-paralon-cost-nano-usd": str(generation.cost_nano_usd)})


@post("/v1/chat/completions", summary="Create a chat completion (OpenAI API)", status_code=200)
async def chat_completions(request: Request) -> ASGIApp:
    return await _complete(request, CHAT)


@post("/v1/completions", summary="Create a completion (OpenAI API)", status_code=200)
async def completions(request: Request) -> ASGIApp:
    return await _complete(request, COMPLETIONS)


@get("/v1/models", summary="Models with their prices and context length")
async def list_models(request: Request) -> Response:
    await _grant(request)
    directory: Directory = request.app.state.directory
    data = []
    for model in directory.models():
        price = directory.prices[model]
        contexts = [w.context_length for w in directory.fleet[model] if w.state == "active" and w.context_length]
        data.append({
            "id": model, "object": "model", "created": 0, "owned_by": "paralon",
            "context_length": max(contexts) if contexts else None,
            "pricing": {
                "input_nano_usd_per_token": price.input_nano_usd_per_token,
                "output_nano_usd_per_token": price.output_nano_usd_per_token,
                "input_usd_per_mtok": nano_usd_to_usd_text(price.input_nano_usd_per_token * TOKENS_PER_MTOK),
                "output_usd_per_mtok": nano_usd_to_usd_text(price.output_nano_usd_per_token * TOKENS_PER_MTOK),
            },
        })
    return _json({"object": "list", "data": data})


@get("/v1/generations/{request_id:str}", summary="The recorded charge of one request")
async def get_generation(request: Request, request_id: str) -> Response:
    grant = await _grant(request)
    engine = request.app.state.ledger.engine

    def lookup():
        with engine.connect() as conn:
            return find_generation(conn, request_id, grant.account_id)

    found = await asyncio.to_thread(lookup)
    if found is None:
        raise UnknownGeneration(f"no settled request {request_id!r} for this key's account")
    return _json(found)


@get("/metrics", summary="Prometheus metrics: read-model lag", include_in_schema=True)
async def metrics(request: Request) -> Response:
    from invoices import read_models

    lag = await asyncio.to_thread(read_models.lag_events, request.app.state.ledger.engine)
    text = ("# HELP paralon_projection_lag_events Events the read models have not applied yet.\n"
            "# TYPE paralon_projection_lag_events gauge\n"
            f'paralon_projection_lag_events{{consumer="{read_models.CONSUMER}"}} {lag}\n')
    return Response(text, media_type="text/plain; version=0.0.4")


@get("/health", summary="Liveness")
async def health() -> Response:
    return _json({"status": "ok"})


def create_app(ledger: Ledger, *, key_cache_ttl_s: float = 1.0, health_interval_s: float = 2.0,
               hold_ttl_s: int = HOLD_TTL_S, hold_sweep_interval_s: float = HOLD_SWEEP_INTERVAL_S,
               stripe_settings=None, crypto_settings=None, invoice_settings=None, embedded_beat: bool = False) -> Litestar:
    directory = Directory(ledger.engine, key_cache_ttl_s=key_cache_ttl_s)

    @asynccontextmanager
    async def lifespan(app: Litestar):
        # https:// workers on a private CA: the operator's bundle (to move into app/settings.py).
        upstream = UpstreamPool(ca_bundle_path=os.environ.get("PARALON_WORKER_CA_BUNDLE") or None)
        client = httpx.AsyncClient(verify=upstream.tls_context,
                                   timeout=httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0),
                                   limits=httpx.Limits(max_connections=UPSTREAM_CONNECTIONS_MAX,
                                                       max_keepalive_connections=UPSTREAM_CONNECTIONS_MAX))
        await directory.refresh_async()
        checker = HealthChecker(directory, client, interval_s=health_interval_s)
        await checker.check_all()
        app.state.directory, app.state.ledger = directory, ledger
        app.state.stripe, app.state.crypto, app.state.invoices = stripe_settings, crypto_settings, invoice_settings
        app.state.background = set()
        app.state.proxy = InferenceProxy(ledger, directory, upstream, hold_ttl_s=hold_ttl_s)
        tasks = [asyncio.create_task(t) for t in (directory.run(), checker.run(), _sweep_holds(ledger, hold_sweep_interval_s), app.state.proxy.keep_holds())]
        if is_postgres(ledger.engine):  # on SQLite the API evicts what it revokes; the CLI waits for the TTL
            tasks.append(asyncio.create_task(follow_revocations(ledger.engine, directory.on_revoked, directory.forget_keys)))
        if embedded_beat:
            from app.jobs.embedded_beat import run_embedded_beat

            tasks.append(asyncio.create_task(run_embedded_beat()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await app.state.proxy.drain_background()
            upstream.close()
            await client.aclose()

    return Litestar(
        route_handlers=[chat_completions, completions, list_models, get_generation, health, metrics, stripe_webhook, *MANAGEMENT_HANDLERS,
                        create_static_files_router(path="/docs/assets", directories=[swagger_ui_path], include_in_schema=False)],
        lifespan=[lifespan],
        exception_handlers={ProxyError: _proxy_error, HTTPException: _http_error},
        openapi_config=OpenAPIConfig(
            title="Paralon", version="0.1.0", path="/docs",
            render_plugins=[SwaggerRenderPlugin(js_url="/docs/assets/swagger-ui-bundle.js", css_url="/docs/assets/swagger-ui.css",
                                                standalone_preset_js_url="/docs/assets/swagger-ui-standalone-preset.js", path="/", favicon="")],
        ),
    )


async def _sweep_holds(ledger: Ledger, interval_s: float) -> None:
    """Close holds a crashed proxy left behind, once they expire: released, or
    settled at the usage they recorded."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(ledger.expire_holds)
        except Exception:
            continue
