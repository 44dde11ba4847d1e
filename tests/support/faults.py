"""Faults that tests inject into real processes and connections."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
from concurrent.futures import Future

from tests.support.harness import free_port

REAP_TIMEOUT_S = 10.0


# --- Crashes -------------------------------------------------------------------
def kill_hard(process: subprocess.Popen) -> None:
    """SIGKILL a process (its whole process group when it leads one: nothing
    it started survives) and reap it. No handler runs: no finally, no
    settlement, no release, as when a machine loses power."""
    if process.poll() is None:
        try:
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
        except ProcessLookupError:  # it exited meanwhile
            pass
    process.wait(REAP_TIMEOUT_S)


# --- Connections ------------------------------------------------------------------
# A TCP proxy that a test puts between `paralon serve` and PostgreSQL, to break
# the network the way production breaks it: cut every connection at once,
# refuse new ones (the database is away), delay every byte, and restore. It
# runs its own asyncio loop in a thread of the test process, so a test drives
# it with plain calls; `stop()` closes everything it opened.
CHUNK_BYTES = 65_536
CALL_TIMEOUT_S = 10.0


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.delay_s = 0.0
        self.connections_accepted = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()

    # What a test calls (from its own thread)
    def start(self) -> "FaultProxy":
        self._thread.start()
        self._call(self._listen())
        return self

    def cut(self) -> int:
        """Close every open connection, both ways; returns how many."""
        return self._call(self._cut())

    def refuse(self) -> None:
        """Stop listening: new connections are refused until `restore()`."""
        self._call(self._stop_listening())

    def outage(self) -> int:
        """The database is away: nothing new gets in, and what was open is cut."""
        self.refuse()
        return self.cut()

    def delay(self, seconds: float) -> None:
        """Hold every chunk this long before passing it on."""
        self.delay_s = seconds

    def restore(self) -> None:
        self.delay_s = 0.0
        self._call(self._listen())

    def stop(self) -> None:
        if self._thread.is_alive():
            self._call(self._stop_listening())
            self._call(self._cut())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CALL_TIMEOUT_S)
        self._loop.close()

    def _call(self, coroutine):
        future: Future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(CALL_TIMEOUT_S)

    # On the proxy's loop
    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True)

    async def _stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _cut(self) -> int:
        pairs, self._pairs = list(self._pairs), set()
        for client, upstream in pairs:
            for writer in (client, upstream):
                writer.transport.abort()  # a reset, as when a network path dies
        return len(pairs)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.transport.abort()
            return
        self.connections_accepted += 1
        pair = (client_writer, upstream_writer)
        self._pairs.add(pair)
        try:
            await asyncio.gather(self._pipe(client_reader, upstream_writer), self._pipe(upstream_reader, client_writer))
        finally:
            self._pairs.discard(pair)
            for writer in pair:
                writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK_BYTES):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()
