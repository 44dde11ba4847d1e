"""The floor under any relay: each caller's connection piped byte for byte to
a connection of its own to the worker, on uvloop, with no HTTP parsed, no
request built and nothing read. What it adds to the first token is what one
more hop through a Python process costs on this machine, whatever the relay
does with the bytes.

    python benchmarks/tcp_forwarder.py --port 9101 --upstream-port 9000
"""
from __future__ import annotations

import argparse
import asyncio

import uvloop


class _ToCaller(asyncio.Protocol):
    """The worker's side: what it sends goes straight to the caller."""

    def __init__(self, caller: asyncio.Transport) -> None:
        self.caller = caller

    def data_received(self, data: bytes) -> None:
        self.caller.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.caller.close()


class _FromCaller(asyncio.Protocol):
    """The caller's side: its bytes wait for the worker's connection, then go straight to it."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.worker: asyncio.Transport | None = None
        self.waiting: list[bytes] = []

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.worker, _ = await loop.create_connection(lambda: _ToCaller(self.transport), "127.0.0.1", self.upstream_port)
        except OSError:
            self.transport.close()
            return
        for data in self.waiting:
            self.worker.write(data)
        self.waiting.clear()

    def data_received(self, data: bytes) -> None:
        if self.worker is None:
            self.waiting.append(data)
        else:
            self.worker.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.worker is not None:
            self.worker.close()
        else:
            self.connecting.cancel()


async def serve(port: int, upstream_port: int) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: _FromCaller(upstream_port), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream_port))


if __name__ == "__main__":
    main()
