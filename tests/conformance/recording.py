"""Everything the clients received from `paralon serve`, as they received it.

`Recorder.install` wraps `httpx.Client.send` and `httpx.AsyncClient.send`,
which the `openai` SDK, LangChain's `ChatOpenAI` and `litellm` all go through
(whatever transport they chose, and for clients a library built and cached
itself). Every response from the serve under test is kept: its status,
headers and body, a streamed body byte for byte as the client read it. Then
each JSON body and each SSE event is checked against the schema OpenAI's
OpenAPI document gives that route (tests/support/openai_spec.py), and the
cost each paid answer reported is read back for the money check."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from decimal import Decimal
from urllib.parse import urlsplit

import httpx

from tests.support import openai_spec

NANO_USD_PER_USD = 10**9
COST_HEADER = "x-paralon-cost-nano-usd"
PAID_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
ENDLESS_STREAM_ROUTES = ("/v1/chat/completions", "/v1/completions")  # streams that end with data: [DONE]
RESPONSE_TERMINAL_EVENTS = ("response.completed", "response.failed", "response.incomplete", "error")
PARALON_ONLY_ROUTES = ("/v1/generations/",)  # not in OpenAI's API: nothing to validate against


@dataclass
class SseEvent:
    event: str | None
    data: str

    def json(self):
        return json.loads(self.data)


@dataclass
class Exchange:
    method: str
    path: str
    status: int
    headers: object  # httpx.Headers, or httpx2.Headers
    body: bytearray = field(default_factory=bytearray)
    read_to_end: bool = False
    request_body: bytes = b""

    @property
    def streamed(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")

    @property
    def paid(self) -> bool:
        return self.method == "POST" and self.path in PAID_ROUTES and 200 <= self.status < 300

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")

    def json(self, **options):
        return json.loads(bytes(self.body), **options)

    def events(self) -> list[SseEvent]:
        """The complete SSE events of the body (a client that stopped early leaves a partial one out)."""
        text = bytes(self.body).decode().replace("\r\n", "\n")
        blocks = text.split("\n\n")
        return [e for e in (_parse_event(b) for b in blocks[:-1]) if e is not None]

    def __str__(self) -> str:
        return f"{self.method} {self.path} -> {self.status}{' (stream)' if self.streamed else ''}"


def _parse_event(block: str) -> SseEvent | None:
    name, data = None, []
    for line in block.split("\n"):
        if line.startswith(":") or not line:
            continue
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            name = value
        elif key == "data":
            data.append(value)
    return SseEvent(name, "\n".join(data)) if data else None


def _tees(http):
    """Stream wrappers of the given httpx flavour (the openai SDK 3 ships its own, `httpx2`) that keep what passes."""

    class Tee(http.SyncByteStream):
        def __init__(self, inner, exchange: Exchange) -> None:
            self.inner, self.exchange = inner, exchange

        def __iter__(self):
            for chunk in self.inner:
                self.exchange.body += chunk
                yield chunk
            self.exchange.read_to_end = True

        def close(self) -> None:
            self.inner.close()

    class AsyncTee(http.AsyncByteStream):
        def __init__(self, inner, exchange: Exchange) -> None:
            self.inner, self.exchange = inner, exchange

        async def __aiter__(self):
            async for chunk in self.inner:
                self.exchange.body += chunk
                yield chunk
            self.exchange.read_to_end = True

        async def aclose(self) -> None:
            await self.inner.aclose()

    return Tee, AsyncTee


def _httpx_flavours() -> list:
    flavours = [httpx]
    try:
        import httpx2
    except ModuleNotFoundError:
        return flavours
    return [*flavours, httpx2]


class Recorder:
    """The responses of one serve (`base_url`), in the order they arrived."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.exchanges: list[Exchange] = []

    def install(self, monkeypatch) -> None:
        for http in _httpx_flavours():
            self._install(monkeypatch, http)

    def _install(self, monkeypatch, http) -> None:
        recorder = self
        tee, async_tee = _tees(http)
        sync_send, async_send = http.Client.send, http.AsyncClient.send

        def send(client, request, *, stream=False, **options):
            response = sync_send(client, request, stream=stream, **options)
            return recorder._keep(request, response, None if stream else response.content, tee)

        async def send_async(client, request, *, stream=False, **options):
            response = await async_send(client, request, stream=stream, **options)
            return recorder._keep(request, response, None if stream else response.content, async_tee)

        monkeypatch.setattr(http.Client, "send", send)
        monkeypatch.setattr(http.AsyncClient, "send", send_async)

    def _keep(self, request, response, content: bytes | None, tee):
        url = str(request.url)
        if not url.startswith(self.base_url + "/v1/"):
            return response
        if response.headers.get("content-encoding", "identity") != "identity":
            raise AssertionError(f"{url}: a compressed body ({response.headers['content-encoding']}) is not recorded")
        exchange = Exchange(request.method, urlsplit(url).path, response.status_code, response.headers,
                            request_body=request.content)
        self.exchanges.append(exchange)
        if content is not None:  # send(stream=False) already read it
            exchange.body += content
            exchange.read_to_end = True
        else:
            response.stream = tee(response.stream, exchange)
        return response

    def to(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == path]

    # --- conformance --------------------------------------------------------

    def assert_conforms(self) -> int:
        """Every body and event against OpenAI's schema; returns how many documents were checked."""
        checked = 0
        for exchange in self.exchanges:
            checked += check_exchange(exchange)
        return checked


def _schemas(exchange: Exchange) -> tuple[str, str | None]:
    """(schema of a JSON body, schema of each SSE event) for this route."""
    method, path = exchange.method, exchange.path
    if exchange.status >= 400:
        return "ErrorResponse", None
    if method == "POST" and path == "/v1/chat/completions":
        return "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse"
    if method == "POST" and path == "/v1/completions":
        return "CreateCompletionResponse", openai_spec.COMPLETION_STREAM_CHUNK
    if method == "POST" and path == "/v1/embeddings":
        asked = json.loads(exchange.request_body or b"{}").get("encoding_format")
        return ("CreateEmbeddingResponse" if asked != "base64" else openai_spec.EMBEDDING_BASE64_RESPONSE), None
    if method == "POST" and path == "/v1/responses":
        return "Response", "ResponseStreamEvent"
    if method == "GET" and path.startswith("/v1/responses/"):
        return "Response", None
    if method == "GET" and path == "/v1/models":
        return "ListModelsResponse", None
    if method == "GET" and path.startswith("/v1/models/"):
        return "Model", None
    raise AssertionError(f"{exchange}: no OpenAI schema is known for this route")


def check_exchange(exchange: Exchange) -> int:
    if any(exchange.path.startswith(p) for p in PARALON_ONLY_ROUTES):
        return 0
    body_schema, event_schema = _schemas(exchange)
    if not exchange.streamed:
        if not exchange.read_to_end:
            raise AssertionError(f"{exchange}: the client never read the body")
        if not exchange.headers.get("content-type", "").startswith("application/json"):
            raise AssertionError(f"{exchange}: content-type {exchange.headers.get('content-type')!r}, not JSON")
        openai_spec.validate(exchange.json(), body_schema, str(exchange))
        return 1
    if event_schema is None:
        raise AssertionError(f"{exchange}: OpenAI never streams this route")
    return _check_stream(exchange, event_schema)


def _check_stream(exchange: Exchange, event_schema: str) -> int:
    events = exchange.events()
    done = [e for e in events if e.data == "[DONE]"]
    documents = [e for e in events if e.data != "[DONE]"]
    for number, event in enumerate(documents):
        where = f"{exchange}, event {number}"
        payload = event.json()
        schema = "ErrorResponse" if "error" in payload and event_schema != "ResponseStreamEvent" else event_schema
        openai_spec.validate(payload, schema, where)
        if event_schema == "ResponseStreamEvent" and event.event is not None and event.event != payload.get("type"):
            raise AssertionError(f"{where}: `event: {event.event}` but the data's type is {payload.get('type')!r}")
    if exchange.read_to_end:
        _check_stream_end(exchange, documents, done)
    return len(documents)


def _check_stream_end(exchange: Exchange, documents: list[SseEvent], done: list[SseEvent]) -> None:
    if exchange.path in ENDLESS_STREAM_ROUTES:
        if len(done) != 1 or exchange.events()[-1].data != "[DONE]":
            raise AssertionError(f"{exchange}: a finished stream ends with exactly one `data: [DONE]`")
        return
    if done:
        raise AssertionError(f"{exchange}: OpenAI's Responses stream has no `data: [DONE]`")
    last_type = documents[-1].json().get("type") if documents else None
    if last_type not in RESPONSE_TERMINAL_EVENTS:
        raise AssertionError(f"{exchange}: the stream ended on {last_type!r}, not on one of {RESPONSE_TERMINAL_EVENTS}")


# --- what each paid answer said it cost ---------------------------------------


def usd_to_nano_usd_exact(value) -> int:
    """usage.cost (a JSON number, or the older decimal string) to integer nano-USD, refusing any rounding."""
    nano = Decimal(str(value)) * NANO_USD_PER_USD
    if nano != nano.to_integral_value():
        raise AssertionError(f"usage.cost {value!r} is not a whole number of nano-USD")
    return int(nano)


def _usage_costs(exchange: Exchange) -> list[int]:
    """Every usage.cost the caller saw, in order (a body's, or each stream event's)."""
    if exchange.streamed:
        payloads = [json.loads(e.data, parse_float=Decimal) for e in exchange.events() if e.data != "[DONE]"]
    else:
        payloads = [exchange.json(parse_float=Decimal)]
    costs = []
    for payload in payloads:
        usage = payload.get("usage") or (payload.get("response") or {}).get("usage") or {}
        if "cost" in usage:
            costs.append(usd_to_nano_usd_exact(usage["cost"]))
    return costs


def reported_cost_nano_usd(exchange: Exchange) -> int | None:
    """What the caller was told it paid: the header, which usage.cost must equal when both are sent;
    None when the answer said nothing (a stream without usage)."""
    header = exchange.headers.get(COST_HEADER)
    costs = _usage_costs(exchange)
    if header is not None:
        if costs and costs[-1] != int(header):
            raise AssertionError(f"{exchange}: usage.cost {costs[-1]} nano-USD but {COST_HEADER}: {header}")
        return int(header)
    return costs[-1] if costs else None
