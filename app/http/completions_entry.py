"""The routes most traffic takes, POST /v1/chat/completions and
/v1/completions, answered by an ASGI entry of their own in front of
Litestar's: the same key check, body limit, proxy call and error JSON,
without Litestar's middleware, routing and argument resolution, which took
about 0.4 ms of each request's first token (benchmarks/ttft_path.py).

Every other request goes through Litestar, and so does a browser's (an
Origin header while CORS is on), whose answer needs CORS headers. The
controllers stay Litestar's too (app/http/inference.py), for the OpenAPI
document; both call the same `complete`."""
from __future__ import annotations

import math

from litestar import Litestar, Request
from litestar.exceptions.http_exceptions import ClientException, RequestEntityTooLarge
from litestar.types import ASGIApp, Receive, Scope, Send

from app.http.errors import EXCEPTION_HANDLERS, database_error_response
from app.http.guards import api_key_grant
from app.http.inference import complete
from app.http.plumbing import parse_json_body
from proxy.generation import CHAT, COMPLETIONS, PATHS

KIND_OF_PATH = {PATHS[CHAT]: CHAT, PATHS[COMPLETIONS]: COMPLETIONS}


class CompletionsEntry:
    def __init__(self, app: Litestar, litestar_handler: ASGIApp) -> None:
        self.app, self.litestar_handler = app, litestar_handler
        self.body_bytes_max = app.request_max_body_size or math.inf
        self.cors = app.cors_config is not None

    @classmethod
    def install(cls, app: Litestar) -> None:
        """In front of the app's own handler (its middleware and routes), once its routes are all registered."""
        app.asgi_handler = cls(app, app.asgi_handler)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = KIND_OF_PATH.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        headers = dict(reversed(scope["headers"])) if kind else {}  # the first of a repeated header, as Litestar's
        if kind is None or (self.cors and b"origin" in headers):
            await self.litestar_handler(scope, receive, send)
            return
        try:
            grant = await api_key_grant(self.app.state.directory, headers.get(b"authorization", b"").decode("latin-1"))
            raw = await self._body(headers, receive)
            if raw is None:  # the caller left before sending it all: nothing to answer
                return
            answer = await complete(self.app.state.proxy, kind, parse_json_body(raw), grant)
        except Exception as exc:  # before the answer starts: the error JSON Litestar's path would send
            answer = _error_answer(scope, receive, exc)
        await answer(scope, receive, send)

    async def _body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes | None:
        """The whole body, refused once it exceeds the app's limit (as Litestar's `Request.body`)."""
        try:
            declared_bytes = int(headers.get(b"content-length", 0))
        except ValueError:
            raise ClientException("Invalid content-length") from None
        if declared_bytes > self.body_bytes_max:
            raise RequestEntityTooLarge
        pieces, received_bytes = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            piece = message.get("body", b"")
            received_bytes += len(piece)
            if received_bytes > self.body_bytes_max:
                raise RequestEntityTooLarge
            pieces.append(piece)
            if not message.get("more_body", False):
                return b"".join(pieces)


def _error_answer(scope: Scope, receive: Receive, exc: Exception) -> ASGIApp:
    """The app's handler for the error's nearest class; anything else is logged and a 500 in the same shape."""
    handler = next((EXCEPTION_HANDLERS[cls] for cls in type(exc).__mro__ if cls in EXCEPTION_HANDLERS), database_error_response)
    request = Request(scope, receive)
    return handler(request, exc).to_asgi_response(app=None, request=request)
