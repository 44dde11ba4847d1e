"""A response's head leaves with its first chunk in one system call
(app/http/write_coalescing.py), or alone at the end of the loop's turn; every
other write goes straight through. What is held is written before a close,
dropped on an abort, and never written to a connection already closing."""
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


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"


def test_a_head_leaves_with_its_first_chunk_and_every_other_write_at_once():
    async def scenario():
        coalescing, recorded, theirs = await _coalescing_pair()
        coalescing.write(HEAD)
        assert recorded.writes == [], "the head waits for what follows it"
        coalescing.write(b"first")
        assert recorded.writes == [HEAD + b"first"], "head and first chunk in one write, at once"
        coalescing.write(b"second")
        assert recorded.writes[-1] == b"second", "a chunk after the head is not held"
        await asyncio.sleep(0)  # the flush scheduled for the head finds nothing left
        coalescing.write(HEAD)
        await asyncio.sleep(0)
        assert recorded.writes == [HEAD + b"first", b"second", HEAD], "a head alone leaves at the turn's end"
        coalescing.write(HEAD)
        coalescing.close()
        assert recorded.writes[-1] == HEAD, "a close writes what is held first"
        assert await _read_to_end(theirs) == HEAD + b"first" + b"second" + HEAD + HEAD
        theirs.close()

    asyncio.run(scenario())


def test_an_abort_drops_what_is_held_and_nothing_is_written_to_a_closing_connection():
    async def scenario():
        coalescing, recorded, theirs = await _coalescing_pair()
        coalescing.write(HEAD)
        coalescing.abort()
        await asyncio.sleep(0)
        assert recorded.writes == []
        assert await _read_to_end(theirs) == b""
        theirs.close()
        coalescing, recorded, theirs = await _coalescing_pair()
        coalescing.write(HEAD)
        recorded.transport.close()  # closed under it, as when the caller leaves
        await asyncio.sleep(0)
        assert recorded.writes == []
        theirs.close()

    asyncio.run(scenario())
