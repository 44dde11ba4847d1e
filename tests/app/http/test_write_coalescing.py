"""Writes to a caller made in one turn of the event loop leave in one system
call (app/http/write_coalescing.py): a stream's headers with its first chunk.
What is held is written before a close, dropped on an abort, and never
written to a connection already closing."""
from __future__ import annotations

import asyncio
import socket

import pytest

from app.http.write_coalescing import CoalescingHttpToolsProtocol, CoalescingTransport
from tests.support.harness import ThreadedServer

CHUNKS = [b"data: first\n\n", b"data: second\n\n", b"data: last\n\n"]
READ_TIMEOUT_S = 10


async def streaming_app(scope, receive, send):
    """Headers and a first chunk in one turn, the rest in later ones."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": CHUNKS[0], "more_body": True})
    for chunk in CHUNKS[1:]:
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture
def server():
    running = ThreadedServer(streaming_app, http=CoalescingHttpToolsProtocol).start()
    yield running
    running.stop()


def _request(connection: str = "keep-alive") -> bytes:
    return f"GET /stream HTTP/1.1\r\nHost: test\r\nConnection: {connection}\r\n\r\n".encode()


def _read_response(sock: socket.socket, first: bytes) -> bytes:
    """Up to the chunked body's end."""
    received = first
    while not received.endswith(b"0\r\n\r\n"):
        piece = sock.recv(65536)
        assert piece, "the connection closed before the response ended"
        received += piece
    return received


def test_the_headers_and_the_first_chunk_arrive_together_and_the_rest_in_order(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=READ_TIMEOUT_S) as sock:
        for _ in range(2):  # and again on the same kept-alive connection
            sock.sendall(_request())
            first = sock.recv(65536)
            assert first.startswith(b"HTTP/1.1 200 OK\r\n") and CHUNKS[0] in first, first
            whole = _read_response(sock, first)
            assert [whole.index(chunk) for chunk in CHUNKS] == sorted(whole.index(chunk) for chunk in CHUNKS)


def test_a_response_on_a_connection_that_closes_arrives_whole_before_the_close(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall(_request("close"))
        received = b""
        while piece := sock.recv(65536):
            received += piece
    assert all(chunk in received for chunk in CHUNKS) and received.endswith(b"0\r\n\r\n")


class RecordingTransport:
    """A real transport whose writes are recorded."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport, self.writes = transport, []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self.transport, name)


async def _coalescing_pair():
    """A CoalescingTransport over a recorded real one, and the socket at the other end."""
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    recorded = RecordingTransport(transport)
    theirs.setblocking(False)
    return CoalescingTransport(recorded, loop), recorded, theirs


async def _read_to_end(sock: socket.socket) -> bytes:
    loop, received = asyncio.get_running_loop(), b""
    while piece := await asyncio.wait_for(loop.sock_recv(sock, 65536), READ_TIMEOUT_S):
        received += piece
    return received


def test_writes_of_one_turn_are_one_write_and_a_close_sends_what_is_held_first():
    async def scenario():
        coalescing, recorded, theirs = await _coalescing_pair()
        coalescing.write(b"a")
        coalescing.write(b"b")
        assert recorded.writes == [], "held until the turn ends"
        await asyncio.sleep(0)
        assert recorded.writes == [b"ab"]
        coalescing.write(b"c")
        coalescing.close()
        assert recorded.writes == [b"ab", b"c"], "a close writes what is held first"
        await asyncio.sleep(0)  # the flush scheduled for "c" finds nothing left
        assert recorded.writes == [b"ab", b"c"]
        assert await _read_to_end(theirs) == b"abc"
        theirs.close()

    asyncio.run(scenario())


def test_an_abort_drops_what_is_held_and_nothing_is_written_to_a_closing_connection():
    async def scenario():
        coalescing, recorded, theirs = await _coalescing_pair()
        coalescing.write(b"dropped")
        coalescing.abort()
        await asyncio.sleep(0)
        assert recorded.writes == []
        assert await _read_to_end(theirs) == b""
        theirs.close()
        coalescing, recorded, theirs = await _coalescing_pair()
        coalescing.write(b"late")
        recorded.transport.close()  # closed under it, as when the caller leaves
        await asyncio.sleep(0)
        assert recorded.writes == []
        theirs.close()

    asyncio.run(scenario())
