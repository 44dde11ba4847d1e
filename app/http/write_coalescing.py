"""Writes to a caller made in one turn of the event loop leave in one system
call. uvicorn writes a response's status line and headers as soon as the app
starts it, and each body chunk as it is sent: a stream's headers and its
first token, or its last token, usage and [DONE], would each wake the
caller's process and cross the network on their own. Gathered, they cost one
write and one wake-up, and the first token arrives with the headers
(benchmarks/ttft_path.py). Nothing waits longer than the end of the turn
that wrote it."""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """The connection's transport, its writes held until the end of the loop's turn; all else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def flush(self) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            if not self._transport.is_closing():  # the caller left meanwhile: nobody to write to
                self._transport.write(data)

    def close(self) -> None:
        self.flush()  # what was written goes before the close, as on the transport itself
        self._transport.close()

    def abort(self) -> None:
        self._held.clear()
        self._transport.abort()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `CoalescingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))
