"""Where a streamed answer's chunks go (proxy.generation.EventWriter).

`paralon serve` gives each request a `ChunkWriter` in its scope's extensions:
the relay writes each chunk to the caller's connection from the worker's
socket read callback, as an HTTP/1.1 chunk on uvicorn's own transport,
instead of waking a task and going through ASGI's `send` for every token
(which was most of what a token cost the proxy). The response's start and
its end still go through `send`, so uvicorn keeps its own account of the
response. Any other server gets a `SendWriter`: the same chunks through
`send`, one message per piece read."""
from __future__ import annotations

from app.http.write_coalescing import CoalescingHttpToolsProtocol

CHUNK_WRITER = "paralon.chunk_writer"  # its key in scope["extensions"]


class ChunkWriter:
    """The body of a chunked response uvicorn started, written directly."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle) -> None:
        self._cycle = cycle  # uvicorn's RequestResponseCycle for this request

    @property
    def usable(self) -> bool:
        """The response was started, chunked, and has not ended."""
        cycle = self._cycle
        return cycle.response_started and cycle.chunked_encoding is True and not cycle.response_complete

    def write(self, chunks: list[bytes]) -> None:
        cycle = self._cycle
        body = b"".join(chunks)
        if body and not cycle.disconnected:  # an empty chunk would end the response
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    @property
    def backed_up(self) -> bool:
        return self._cycle.flow.write_paused and not self._cycle.disconnected

    @property
    def gone(self) -> bool:
        return self._cycle.disconnected

    async def drain(self) -> None:
        await self._cycle.flow.drain()  # set again when the caller catches up or leaves


class SendWriter:
    """The chunks as ASGI messages: they wait for `drain`, which the relay
    calls after each piece it read, since a write may not wait."""

    __slots__ = ("_send", "_waiting")
    gone = False  # `send` does not say; the relay is cancelled when the caller leaves

    def __init__(self, send) -> None:
        self._send, self._waiting = send, []

    def write(self, chunks: list[bytes]) -> None:
        self._waiting.extend(chunks)

    @property
    def backed_up(self) -> bool:
        return bool(self._waiting)

    async def drain(self) -> None:
        body = b"".join(self._waiting)
        self._waiting.clear()
        await self._send({"type": "http.response.body", "body": body, "more_body": True})


def writer_for(scope, send) -> ChunkWriter | SendWriter:
    """After the response started: the direct writer when the server gave one it can use."""
    direct = scope.get("extensions", {}).get(CHUNK_WRITER)
    return direct if direct is not None and direct.usable else SendWriter(send)


class ChunkWriterProtocol(CoalescingHttpToolsProtocol):
    """uvicorn's httptools protocol, head coalesced, with a `ChunkWriter` in each request's scope."""

    def on_headers_complete(self) -> None:
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not previous:  # a new request's cycle (not an upgrade)
            self.scope.setdefault("extensions", {})[CHUNK_WRITER] = ChunkWriter(self.cycle)
