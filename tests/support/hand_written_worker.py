"""A worker of the tests' own, as an ASGI app for `ThreadedServer`: it
answers the health check and the model list as a vLLM worker does, records
every completion body it gets, and streams the chunks a test gives it."""
from __future__ import annotations

import asyncio

import orjson

from tests.support.harness import MODEL


class HandWrittenWorker:
    """A worker of our own: records every body it gets and streams `chunks(body)`."""

    def __init__(self, chunks) -> None:
        self.chunks = chunks
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/chat/completions":
            known = {"/health": b"", "/v1/models": orjson.dumps({"data": [{"id": MODEL, "max_model_len": 32768}]})}
            await send({"type": "http.response.start", "status": 200 if scope["path"] in known else 404, "headers": []})
            await send({"type": "http.response.body", "body": known.get(scope["path"], b"")})
            return
        raw, more = b"", True
        while more:
            message = await receive()
            raw, more = raw + message.get("body", b""), message.get("more_body", False)
        body = orjson.loads(raw)
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for chunk in self.chunks(body):
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n", "more_body": True})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
