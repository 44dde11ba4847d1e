"""A lean HTTP/1.1 client for the relay: keep-alive connections to workers,
responses parsed by httptools (uvicorn's C parser), body pieces handed over as
they arrive, and an abort that closes the connection (which is how vLLM and
llama.cpp learn to stop generating).

A general client (httpx) costs about as much CPU per streamed token as the
rest of the proxy together; the relay does only this, so it does it directly.

`https://` workers are reached over TLS with their certificate and host name
verified, against the system's certificate authorities or, when one is
given, a CA bundle of the operator's (workers on a private CA).
"""
from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import urlsplit

import httptools

from proxy.limits import (
    UPSTREAM_CONNECT_TIMEOUT_S,
    UPSTREAM_IDLE_CONNECTIONS_PER_WORKER_MAX,
    UPSTREAM_IDLE_TIMEOUT_S,
    UPSTREAM_READ_PAUSE_BYTES,
    UPSTREAM_READ_RESUME_BYTES,
)

DEFAULT_PORTS = {"http": 80, "https": 443}


def worker_tls_context(ca_bundle_path: str | None = None) -> ssl.SSLContext:
    """Verifies a worker's certificate and host name: against the CA bundle
    when one is given (and only it), else the system's authorities."""
    return ssl.create_default_context(cafile=ca_bundle_path)


class _Origin(NamedTuple):
    """Where a pooled connection goes: connections are reused only for the same one."""
    scheme: str
    host: str
    port: int


class UpstreamError(Exception):
    """The worker could not be reached, or broke the connection."""


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.headers_done: asyncio.Future = loop.create_future()
        self.pieces: deque[bytes] = deque()
        self.buffered_bytes = 0
        self.waiter: asyncio.Future | None = None
        # Set while a reader pours the body (UpstreamResponse.pour): pieces go to it as they arrive.
        self.sink: Callable[[bytes], bool] | None = None
        self.complete = self.lost = self.paused = self.keep_alive = False
        self.reused = self.answered = False  # kept alive from an earlier response; a byte of this one arrived
        self.last_activity_s = loop.time()

    def reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers_done = self.loop.create_future()
        self.complete = self.keep_alive = self.answered = False
        self.reused = True

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.last_activity_s = self.loop.time()
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed response from the worker: {exc}"))
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(UpstreamError("the worker closed the connection"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        if not self.headers_done.done():
            self.headers_done.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            if not self.sink(body):  # the reader has what it waited for: wake it
                self.sink = None
                self._wake()
            return
        self.pieces.append(body)
        self.buffered_bytes += len(body)
        if self.buffered_bytes > UPSTREAM_READ_PAUSE_BYTES and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
        self._wake()

    def take(self) -> bytes | None:
        piece = self.pieces.popleft()
        self.buffered_bytes -= len(piece)
        self.last_activity_s = self.loop.time()  # a slow reader is not a silent worker
        if self.paused and self.buffered_bytes < UPSTREAM_READ_RESUME_BYTES:
            self.paused = False
            self.transport.resume_reading()
        return piece


class UpstreamResponse:
    def __init__(self, pool: UpstreamPool, origin: _Origin, connection: _Connection, status: int) -> None:
        self._pool, self._origin, self._conn = pool, origin, connection
        self.status = status
        self._done = False
        # One watchdog per response, not a timer per token: a worker silent for
        # the pool's idle timeout loses the connection, which wakes the reader with an error.
        self._watchdog = connection.loop.call_later(pool.idle_timeout_s, self._check_idle)

    def _check_idle(self) -> None:
        idle_timeout_s = self._pool.idle_timeout_s
        silent_s = self._conn.loop.time() - self._conn.last_activity_s
        if silent_s >= idle_timeout_s and not self._conn.paused:
            self.abort()
        elif not self._done:
            self._watchdog = self._conn.loop.call_later(max(idle_timeout_s - silent_s, 1.0), self._check_idle)

    async def pieces(self):
        """Body bytes as they arrive (chunked encoding already undone)."""
        conn = self._conn
        while True:
            if conn.pieces:
                yield conn.take()
            elif conn.complete:
                self._finish()
                return
            elif conn.lost:
                self._end()
                raise UpstreamError("the worker closed the connection mid-response")
            else:
                conn.waiter = conn.loop.create_future()
                try:
                    await conn.waiter
                finally:
                    conn.waiter = None

    async def pour(self, sink: Callable[[bytes], bool]) -> bool:
        """Hand each body piece to `sink` as it arrives, in the socket's read
        callback itself: no task wakes for a piece the sink takes. The sink
        returns False to have this return (then False); True when the response
        ended (its connection goes back to the pool). A lost connection raises
        UpstreamError. The sink must not raise."""
        conn = self._conn
        while conn.pieces:  # read before the sink was there
            if not sink(conn.take()):
                return False
        conn.sink = sink
        try:
            while conn.sink is not None and not conn.complete and not conn.lost:
                conn.waiter = conn.loop.create_future()
                await conn.waiter
        finally:
            stopped, conn.sink, conn.waiter = conn.sink is None, None, None
        if stopped:  # what arrived after it stopped waits for the next pour
            return False
        if conn.complete:
            self._finish()
            return True
        self._end()
        raise UpstreamError("the worker closed the connection mid-response")

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])

    def _end(self) -> bool:
        """The response is over: stop watching it. False when it already was."""
        if self._done:
            return False
        self._done = True
        self._watchdog.cancel()
        return True

    def _finish(self) -> None:
        if self._end():
            self._pool.release(self._origin, self._conn)

    def close(self) -> None:
        """Done with it: back to the pool if the response ended cleanly, else abort."""
        if self._conn.complete and not self._conn.pieces:
            self._finish()
        else:
            self.abort()

    def abort(self) -> None:
        """Close the connection: the worker stops generating."""
        if self._end() and self._conn.transport is not None:
            self._conn.transport.abort()


class UpstreamPool:
    def __init__(self, *, ca_bundle_path: str | None = None, idle_timeout_s: float = UPSTREAM_IDLE_TIMEOUT_S) -> None:
        self.tls_context = worker_tls_context(ca_bundle_path)  # also for the health checks' client
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[_Origin, list[_Connection]] = {}

    async def post(self, url: str, body: bytes, headers: dict[str, str] | None = None) -> UpstreamResponse:
        parts = urlsplit(url)
        if parts.scheme not in DEFAULT_PORTS:
            raise UpstreamError(f"a worker is reached over http:// or https://, not {parts.scheme}://")
        origin = _Origin(parts.scheme, parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORTS[parts.scheme])
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        head = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {origin.host}:{origin.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\n{extra}Content-Length: {len(body)}\r\n\r\n").encode()
        connection = await self._acquire(origin)
        try:
            return await self._send(origin, connection, head + body)
        except UpstreamError:
            if not connection.reused or connection.answered:
                raise
        # The worker closed a kept-alive connection as this request went out (uvicorn,
        # which vLLM runs on, closes one idle for 5 s): it never started, so send it
        # again, once, on a new connection.
        return await self._send(origin, await self._connect(origin), head + body)

    async def _send(self, origin: _Origin, connection: _Connection, request: bytes) -> UpstreamResponse:
        connection.transport.write(request)
        try:
            status = await connection.headers_done
        except BaseException:  # failed, or the caller gave up: either way the worker must stop
            connection.transport.abort()
            raise
        return UpstreamResponse(self, origin, connection, status)

    async def _acquire(self, origin: _Origin) -> _Connection:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.lost:
                connection.reset()
                return connection
        return await self._connect(origin)

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = {"ssl": self.tls_context, "server_hostname": origin.host} if origin.scheme == "https" else {}
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), origin.host, origin.port, **tls), UPSTREAM_CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:  # ssl.SSLError (an untrusted certificate) is an OSError
            raise UpstreamError(f"cannot connect to {origin.host}:{origin.port}: {exc or type(exc).__name__}") from None
        return connection

    def release(self, origin: _Origin, connection: _Connection) -> None:
        if connection.lost or not connection.keep_alive or connection.pieces:
            connection.transport.close()
            return
        idle = self._idle.setdefault(origin, [])
        if len(idle) < UPSTREAM_IDLE_CONNECTIONS_PER_WORKER_MAX:
            idle.append(connection)
        else:
            connection.transport.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.transport.close()
        self._idle.clear()
