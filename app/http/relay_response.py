"""The streaming answer as a bare ASGI response: its chunks go to the
server's direct writer when it has one (app/http/chunk_writers.py), else
through `send`; a disconnect cancels the relay at once (which aborts the
upstream request and bills what was produced)."""
from __future__ import annotations

import asyncio

from app.http.chunk_writers import writer_for
from proxy.generation import Generation

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class RelayResponse:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        headers = [*SSE_HEADERS, (b"x-request-id", self.generation.request_id.encode())]
        relay = asyncio.current_task()
        left = False

        async def watch_disconnect() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            relay.cancel()

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await self.generation.relay_to(writer_for(scope, send))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
        finally:
            watcher.cancel()
