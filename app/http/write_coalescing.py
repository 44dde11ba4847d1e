"""A response's head leaves with its first chunk, in one system call.
uvicorn writes a response's status line and headers as soon as the app
starts it, and each body chunk as it is sent: a stream's headers would wake
the caller's process and cross the network on their own, ahead of its first
token (about 0.24 ms of the first token in benchmarks/ttft_path.py). Held
until the next write, or at most to the end of the loop's turn, they leave
together. Every other write goes straight through: a token costs nothing
more."""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# How every response head uvicorn writes begins (its status lines, 100 Continue's too).
STATUS_LINE_START = b"HTTP/1.1 "


class CoalescingTransport:
    """The connection's transport, a response's head held for what follows it; all else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if self._held:  # the head's first companion: both leave now
            self._held.append(data)
            self.flush()
        elif data.startswith(STATUS_LINE_START):
            self._held.append(data)
            self._loop.call_soon(self.flush)  # a head alone (no body yet) leaves at the turn's end
        else:
            self._transport.write(data)

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
