"""The relay's HTTP client against small real servers on localhost."""
from __future__ import annotations

import asyncio
import ssl

import pytest

from proxy.upstream import UpstreamError, UpstreamPool
from tests.proxy.tls import ServerCertificate, make_server_certificate


async def _server(handler, tls: ServerCertificate | None = None):
    context = None
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls.certificate, tls.key)
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=context)
    scheme = "https" if tls else "http"
    return server, f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return await reader.readexactly(length)


def test_a_kept_alive_connection_the_worker_closed_is_replaced_and_the_request_sent_once_more():
    """Given a worker that answers one request per connection, keeps it alive,
    then closes it when the next request arrives (a keep-alive timeout racing the
    request), when a second request goes out on the kept connection, then it is
    sent again on a new connection and answered; a fresh connection that fails
    is not retried."""
    received = []

    async def handler(reader, writer):
        received.append(await _read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        try:
            await reader.readuntil(b"\r\n\r\n")  # the next request on this connection: closed unanswered
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    async def main():
        server, url = await _server(handler)
        pool = UpstreamPool()
        answers = []
        for i in range(3):
            response = await pool.post(url + "/v1/x", f"req{i}".encode())
            answers.append((response.status, await response.read()))
        pool.close()
        server.close()
        return answers

    assert asyncio.run(main()) == [(200, b"ok")] * 3
    assert received == [b"req0", b"req1", b"req2"], "each request reached the worker once"


def test_a_new_connection_closed_before_any_answer_is_not_sent_again():
    attempts = []

    async def handler(reader, writer):
        attempts.append(await _read_request(reader))
        writer.close()

    async def main():
        server, url = await _server(handler)
        pool = UpstreamPool()
        try:
            with pytest.raises(UpstreamError):
                await pool.post(url + "/v1/x", b"once")
        finally:
            pool.close()
            server.close()

    asyncio.run(main())
    assert attempts == [b"once"]


def test_chunked_pieces_arrive_in_order_and_the_connection_is_reused():
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        while True:
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in (b"data: 1\n\n", b"data: " + body + b"\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")

    async def main():
        server, url = await _server(handler)
        pool = UpstreamPool()
        bodies = []
        for i in range(3):
            response = await pool.post(url + "/v1/x", f"req{i}".encode())
            assert response.status == 200
            bodies.append(await response.read())
        pool.close()
        server.close()
        return bodies

    assert asyncio.run(main()) == [b"data: 1\n\ndata: req%d\n\n" % i for i in range(3)]
    assert len(connections) == 1, "keep-alive: one connection for three requests"


def test_pour_hands_each_piece_to_the_sink_in_the_read_callback_and_keeps_what_came_after_it_stopped():
    """Given a chunked stream, when it is poured into a sink, then each piece
    reaches the sink from the socket's read callback (no task runs it); a sink
    that stops makes pour return False, and the pieces that arrived with or
    after the one it stopped at wait, in order, for the next pour; the end of
    the response returns True and the connection is kept for the next request;
    a connection lost mid-response raises."""
    connections = []

    async def main():
        proceed = asyncio.Queue()

        async def handler(reader, writer):
            connections.append(writer)
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await proceed.get()
            writer.write(b"1\r\na\r\n")
            await proceed.get()
            writer.write(b"1\r\nb\r\n1\r\nc\r\n")  # one read: the sink stops at b, c waits
            await proceed.get()
            writer.write(b"1\r\nd\r\n0\r\n\r\n")
            await _read_request(reader)  # the next request, on the same connection
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\ne\r\n")
            await writer.drain()
            writer.close()  # before the last chunk

        server, url = await _server(handler)
        pool = UpstreamPool()
        taken, tasks = [], []

        def sink(piece: bytes) -> bool:
            taken.append(piece)
            tasks.append(asyncio.current_task())
            if piece == b"a":
                proceed.put_nowait(None)
            return piece != b"b"

        response = await pool.post(url, b"{}")
        proceed.put_nowait(None)
        assert await response.pour(sink) is False
        assert taken == [b"a", b"b"]
        proceed.put_nowait(None)
        assert await response.pour(sink) is True
        assert taken == [b"a", b"b", b"c", b"d"]
        assert tasks[:2] == [None, None] and tasks[3] is None, "pieces arriving while it pours are taken in the read callback"
        assert tasks[2] is asyncio.current_task(), "c, which waited, is taken by the second pour itself"

        second = await pool.post(url, b"{}")
        with pytest.raises(UpstreamError):
            await second.pour(sink)
        assert taken[-1] == b"e"
        pool.close()
        server.close()

    asyncio.run(main())
    assert len(connections) == 1, "the first response ended cleanly: its connection was kept"


def test_abort_closes_the_connection_so_the_worker_stops():

    async def main():
        closed = asyncio.Event()

        async def handler(reader, writer):
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            if await reader.read() == b"":  # the client went away
                closed.set()

        server, url = await _server(handler)
        pool = UpstreamPool()
        response = await pool.post(url, b"{}")
        pieces = response.pieces()
        assert await pieces.__anext__() == b"hello"
        response.abort()
        await asyncio.wait_for(closed.wait(), 5)
        server.close()

    asyncio.run(main())


def test_a_silent_worker_and_a_closed_port_are_upstream_errors():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)  # never another byte

    async def main():
        server, url = await _server(handler)
        pool = UpstreamPool(idle_timeout_s=0.2)
        response = await pool.post(url, b"{}")
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(response.read(), 3)
        with pytest.raises(UpstreamError):
            await pool.post("http://127.0.0.1:9/v1/x", b"{}")
        server.close()

    asyncio.run(main())


async def _echo(reader, writer):
    """Answers each request on the connection with its own body."""
    while True:
        try:
            body = await _read_request(reader)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):  # closed, or the certificate refused
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()


def test_an_https_worker_is_relayed_when_its_certificate_is_trusted(tmp_path):
    """Given a worker on a private CA, when the pool trusts that CA's bundle,
    then requests go through over TLS, on one connection."""
    worker_tls = make_server_certificate(tmp_path, "workers")
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        await _echo(reader, writer)

    async def main():
        server, url = await _server(handler, worker_tls)
        pool = UpstreamPool(ca_bundle_path=str(worker_tls.ca_bundle))
        bodies = [await (await pool.post(url + "/v1/x", f"req{i}".encode())).read() for i in range(2)]
        pool.close()
        server.close()
        return bodies

    assert asyncio.run(main()) == [b"req0", b"req1"]
    assert len(connections) == 1


@pytest.mark.parametrize("trusted", ["system", "another private CA"])
def test_an_https_worker_with_an_untrusted_certificate_is_an_upstream_error(tmp_path, trusted):
    worker_tls = make_server_certificate(tmp_path, "workers")
    ca_bundle = None if trusted == "system" else str(make_server_certificate(tmp_path, "other").ca_bundle)

    async def main():
        server, url = await _server(_echo, worker_tls)
        pool = UpstreamPool(ca_bundle_path=ca_bundle)
        try:
            with pytest.raises(UpstreamError, match="certificate verify failed"):
                await pool.post(url + "/v1/x", b"{}")
        finally:
            server.close()

    asyncio.run(main())


def test_a_worker_url_of_another_scheme_is_an_upstream_error():
    async def main():
        with pytest.raises(UpstreamError, match="http:// or https://"):
            await UpstreamPool().post("ftp://127.0.0.1:21/v1/x", b"{}")

    asyncio.run(main())
