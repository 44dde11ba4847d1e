"""The relay's writers (app/http/chunk_writers.py) on uvicorn over real
sockets: under `paralon serve`'s protocol a request's scope carries a
`ChunkWriter` that writes each batch of chunks as one HTTP/1.1 chunk on the
connection, keeps the response open on an empty batch, drops writes once the
caller left, and reports and waits out a caller that stopped reading; any
other server, or a response that is not chunked, gets the `SendWriter`."""
from __future__ import annotations

import socket
import threading

import pytest

from app.http.chunk_writers import CHUNK_WRITER, ChunkWriter, ChunkWriterProtocol, SendWriter, writer_for
from tests.support.harness import ThreadedServer

READ_TIMEOUT_S = 10
BIG_CHUNK = b"x" * 65536
BIG_CHUNKS_MAX = 2000  # 128 MB: far beyond any socket buffer, so the writer must back up first


class WritingApp:
    """Starts a chunked response, then writes through `writer_for` what the path asks for."""

    def __init__(self) -> None:
        self.writers: list[object] = []
        self.backed_up_after = 0  # big chunks written before the writer backed up
        self.backed_up = threading.Event()
        self.drained = threading.Event()
        self.left = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"]
        headers = [(b"content-type", b"text/event-stream")]
        if path == "/fixed":
            headers.append((b"content-length", b"4"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        writer = writer_for(scope, send)
        self.writers.append(writer)
        if path == "/fixed":
            await send({"type": "http.response.body", "body": b"done", "more_body": False})
            return
        if path == "/slow-caller":
            await self._until_backed_up(writer)
        elif path == "/caller-leaves":
            while (await receive())["type"] != "http.disconnect":
                pass
            writer.write([b"after the caller left"])
            self.left.set()
            return
        else:
            writer.write([b"one", b"two"])
            writer.write([])
            writer.write([b"three"])
        if writer.backed_up:
            await writer.drain()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _until_backed_up(self, writer) -> None:
        while not writer.backed_up and self.backed_up_after < BIG_CHUNKS_MAX:
            writer.write([BIG_CHUNK])
            self.backed_up_after += 1
        self.backed_up.set()
        await writer.drain()
        self.drained.set()


@pytest.fixture
def app():
    return WritingApp()


@pytest.fixture
def serve_protocol(app):
    running = ThreadedServer(app, http=ChunkWriterProtocol).start()
    yield running
    running.stop()


def _exchange(port: int, path: str, requests: int = 1) -> list[bytes]:
    """Each response, whole, of `requests` GETs on one kept-alive connection."""
    responses = []
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as sock:
        for _ in range(requests):
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
            received = b""
            while not (received.endswith(b"0\r\n\r\n") or received.endswith(b"\r\n\r\ndone")):
                piece = sock.recv(65536)
                assert piece, "the connection closed before the response ended"
                received += piece
            responses.append(received)
    return responses


def _body(response: bytes) -> bytes:
    return response.split(b"\r\n\r\n", 1)[1]


def test_each_batch_is_one_chunk_an_empty_batch_writes_nothing_and_uvicorn_ends_the_response(app, serve_protocol):
    first, second = _exchange(serve_protocol.port, "/stream", requests=2)
    for response in (first, second):  # the connection stays usable: uvicorn's account of the response held
        assert response.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in response
        assert _body(response) == b"6\r\nonetwo\r\n5\r\nthree\r\n0\r\n\r\n"
    assert all(type(writer) is ChunkWriter for writer in app.writers)


def test_any_other_server_or_a_response_with_a_length_gets_the_send_writer(app):
    plain = ThreadedServer(app, http="httptools").start()
    try:
        [response] = _exchange(plain.port, "/stream")
    finally:
        plain.stop()
    assert _body(response) == b"b\r\nonetwothree\r\n0\r\n\r\n", "what waited goes out at the drain, as one message"
    served = ThreadedServer(app, http=ChunkWriterProtocol).start()
    try:
        [fixed] = _exchange(served.port, "/fixed")
    finally:
        served.stop()
    assert _body(fixed) == b"done"
    assert [type(writer) for writer in app.writers] == [SendWriter, SendWriter]


def test_a_caller_that_stops_reading_backs_the_writer_up_and_drain_waits_until_it_reads(app, serve_protocol):
    with socket.create_connection(("127.0.0.1", serve_protocol.port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall(b"GET /slow-caller HTTP/1.1\r\nHost: test\r\n\r\n")
        assert app.backed_up.wait(READ_TIMEOUT_S)
        assert app.backed_up_after < BIG_CHUNKS_MAX, "the writer backed up while the caller read nothing"
        assert not app.drained.wait(0.3), "drain returned while the caller still read nothing"
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            piece = sock.recv(1 << 20)
            assert piece
            received += piece
    assert app.drained.is_set()
    body = _body(received)
    assert body.count(b"10000\r\n" + BIG_CHUNK + b"\r\n") == app.backed_up_after, "every chunk arrived, whole"


def test_writes_after_the_caller_left_are_dropped_and_the_writer_says_it_is_gone(app, serve_protocol):
    with socket.create_connection(("127.0.0.1", serve_protocol.port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall(b"GET /caller-leaves HTTP/1.1\r\nHost: test\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
    assert app.left.wait(READ_TIMEOUT_S), "the write after the caller left raised, or never came"
    assert not app.writers[0].backed_up and app.writers[0].gone


def test_the_writer_is_in_the_scope_of_every_request_on_a_connection():
    scopes = []

    async def recording_app(scope, receive, send):
        scopes.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    running = ThreadedServer(recording_app, http=ChunkWriterProtocol).start()
    try:
        _exchange(running.port, "/", requests=2)
    finally:
        running.stop()
    writers = [scope["extensions"][CHUNK_WRITER] for scope in scopes]
    assert len(writers) == 2 and writers[0] is not writers[1], "each request its own, for its own response"
