"""A simulated GPU worker that speaks vLLM's OpenAI-compatible HTTP API.

A plain ASGI3 callable (no framework) so that the worker costs little per
chunk and never becomes the bottleneck of a proxy benchmark. The GPU it
models is proxy/sim/engine.py; how it reads requests, proxy/sim/requests.py;
how it answers, proxy/sim/emitters.py; its command line, proxy/sim/cli.py.

Endpoints: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses
(proxy/sim/responses.py) (streaming or not),
GET /v1/models, GET /health, GET /metrics (Prometheus text, vLLM's names),
POST /tokenize (proxy/sim/tokenize.py), POST /v1/embeddings (proxy/sim/embeddings.py).

Request fields for tests that call the worker directly (vLLM ignores unknown
fields, so a client may always send them; the proxy forwards none of them):
- "sim_tokens": N                      stop after N tokens with finish_reason
                                       "stop" (N >= max_tokens gives "length";
                                       0 gives an empty completion)
- "sim_fail_before_first_token": true  HTTP 500, OpenAI-style error, nothing
                                       streamed
- "sim_fail_after_tokens": N           close the connection after N tokens,
                                       without [DONE] (streaming); a bare 500
                                       without a body shape when not streaming
- "sim_extra_tokens": N                generate N tokens past max_tokens (a worker
                                       that ignores the limit)
- "sim_inflate_usage": K               report prompt and completion tokens
                                       multiplied by K (a dishonest worker);
                                       overrides build_app(inflate_usage=...)

The same behaviours for every request, for tests that go through the proxy:
build_app(stop_after_tokens=N, fail_after_tokens=N, extra_tokens=N,
inflate_usage=K), or --stop-after-tokens, --fail-after-tokens, --extra-tokens,
--inflate-usage on the command line. They are plain attributes of the app, so a
test may change them between requests; a request's own field wins.

`time_scale` (or PARALON_SIM_TIME_SCALE) divides every delay. A client
disconnect stops generation at once and counts as an abort.
"""
from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import generate_latest

from proxy.limits import SIM_REQUEST_BODY_BYTES_MAX
from proxy.sim import embeddings, metrics
from proxy.sim import responses as sim_responses
from proxy.sim.emitters import JSON_HEADERS, JsonEmitter, StreamEmitter, send_body
from proxy.sim.engine import Call, Engine, EngineState, GenerationRequest, SimulatedCrash
from proxy.sim.profiles import SimProfile, get_profile
from proxy.sim.requests import Behaviour, HttpError, parse_request
from proxy.sim.tokenize import TokenizeRoute

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

TIME_SCALE_ENV = "PARALON_SIM_TIME_SCALE"


class SimWorker:
    """The ASGI3 application; `state` holds the engine's counters."""

    def __init__(
        self,
        profile: SimProfile,
        model: str,
        *,
        seed: int,
        max_model_len: int | None,
        inflate_usage: int,
        time_scale: float,
        stop_after_tokens: int | None = None,
        fail_after_tokens: int | None = None,
        extra_tokens: int = 0,
    ) -> None:
        if inflate_usage < 1:
            raise ValueError("inflate_usage must be at least 1")
        self.engine = Engine(profile, seed=seed, time_scale=time_scale)
        self.profile = profile
        self.model = model
        self.max_model_len = max_model_len or profile.max_model_len_tokens
        self.inflate_usage = inflate_usage
        self.stop_after_tokens = stop_after_tokens
        self.fail_after_tokens = fail_after_tokens
        self.extra_tokens = extra_tokens
        self.time_scale = time_scale
        self.created = int(time.time())
        self.metrics = metrics.engine_registry(self.engine, model)
        self._routes: dict[str, tuple[str, Callable[[Scope, Receive, Send], Awaitable[None]]]] = {
            "/v1/chat/completions": ("POST", self._chat_completions),
            "/v1/completions": ("POST", self._completions),
            "/v1/responses": ("POST", functools.partial(sim_responses.endpoint, self)),
            embeddings.PATH: ("POST", embeddings.EmbeddingRoute(self, _read_body)),
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            "/tokenize": ("POST", TokenizeRoute(self)),
        }

    @property
    def state(self) -> EngineState:
        return self.engine.state

    def text_of(self, completion_tokens: int) -> str:
        return self.engine.text_of(completion_tokens)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._route(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes.get(scope["path"])
        if route is None:
            await send_body(send, 404, b'{"detail":"Not Found"}', JSON_HEADERS)
            return
        method, handler = route
        if scope["method"] != method:
            await send_body(send, 405, b'{"detail":"Method Not Allowed"}', JSON_HEADERS)
            return
        await handler(scope, receive, send)

    # --- simple endpoints ---

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_body(send, 200, b"", [])

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        await send_body(send, 200, orjson.dumps({"object": "list", "data": [card]}), JSON_HEADERS)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_body(send, 200, generate_latest(self.metrics), [(b"content-type", metrics.CONTENT_TYPE.encode())])

    # --- generation ---

    async def _chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generation_endpoint(receive, send, chat=True)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generation_endpoint(receive, send, chat=False)

    async def _generation_endpoint(self, receive: Receive, send: Send, chat: bool) -> None:
        try:
            request = self.parse_request(await _read_body(receive), chat)
        except HttpError as error:
            await _send_error(send, error)
            return
        except ConnectionResetError:
            return
        if request.fail_before_first_token:
            self.state.requests_failed += 1
            await _send_error(send, HttpError(500, "InternalServerError", "Simulated failure before the first token."))
            return
        await self._run_generation(request, receive, send)

    def parse_request(self, body: bytes, chat: bool) -> GenerationRequest:
        behaviour = Behaviour(self.stop_after_tokens, self.fail_after_tokens, self.extra_tokens, self.inflate_usage)
        return parse_request(body, chat=chat, model=self.model, max_model_len=self.max_model_len, behaviour=behaviour)

    def _response_base(self, chat: bool) -> dict[str, Any]:
        if chat:
            id_, object_ = f"chatcmpl-{uuid.uuid4().hex}", "chat.completion.chunk"
        else:
            id_, object_ = f"cmpl-{uuid.uuid4().hex}", "text_completion"
        return {"id": id_, "object": object_, "created": int(time.time()), "model": self.model}

    async def _run_generation(self, request: GenerationRequest, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        call = Call(loop)
        base = self._response_base(request.chat)
        if request.stream:
            emitter: StreamEmitter | JsonEmitter = StreamEmitter(request, send, call, base)
        else:
            base["object"] = "chat.completion" if request.chat else "text_completion"
            emitter = JsonEmitter(request, send, call, base)
        self.state.requests_started += 1
        watcher = loop.create_task(_watch_disconnect(receive, call))
        try:
            await emitter.start()
            await self.engine.generate(request, call, emitter)
        except SimulatedCrash:
            # Returning without completing the response makes the server drop the connection.
            self.state.requests_failed += 1
            return
        finally:
            call.finished = True
            watcher.cancel()
        if call.disconnected:
            self.state.requests_aborted += 1
        else:
            self.state.requests_finished += 1


async def _watch_disconnect(receive: Receive, call: Call) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            call.on_disconnect()
            return


async def _send_error(send: Send, error: HttpError) -> None:
    await send_body(send, error.status, error.body(), JSON_HEADERS)


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size_bytes = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client left before sending its request")
        body = message.get("body", b"")
        size_bytes += len(body)
        if size_bytes > SIM_REQUEST_BODY_BYTES_MAX:
            raise HttpError(413, "BadRequestError", f"request body above {SIM_REQUEST_BODY_BYTES_MAX} bytes")
        parts.append(body)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _time_scale_from_env() -> float:
    return float(os.environ.get(TIME_SCALE_ENV, "1") or "1")


def build_app(
    profile: str = "instant",
    model: str = "paralon-demo",
    *,
    seed: int = 0,
    max_model_len: int | None = None,
    inflate_usage: int = 1,
    time_scale: float | None = None,
    stop_after_tokens: int | None = None,
    fail_after_tokens: int | None = None,
    extra_tokens: int = 0,
) -> SimWorker:
    """An ASGI3 app; time_scale defaults to $PARALON_SIM_TIME_SCALE, else 1.
    stop_after_tokens, fail_after_tokens, extra_tokens and inflate_usage apply
    to every request, as the sim_* request fields do to one."""
    return SimWorker(
        get_profile(profile),
        model,
        seed=seed,
        max_model_len=max_model_len,
        inflate_usage=inflate_usage,
        time_scale=_time_scale_from_env() if time_scale is None else time_scale,
        stop_after_tokens=stop_after_tokens,
        fail_after_tokens=fail_after_tokens,
        extra_tokens=extra_tokens,
    )
