"""An idle client connection outlives the client's own keep-alive.

The `openai` SDK (httpx) keeps an idle connection 5 s; uvicorn closed them at
5 s too. A request sent on a pooled connection just as the server's timer
closed it was reset, and the caller saw a `ReadError` with nothing relayed.
The server now keeps idle connections for longer than its clients do, so the
client is the one that closes them."""
from __future__ import annotations

import socket
import time

from app.limits import HTTP_IDLE_CONNECTION_KEPT_S
from tests.conftest import migrated_database_url
from tests.support.harness import serving

HTTPX_KEEPALIVE_EXPIRY_S = 5.0  # httpx's default, which the `openai` SDK keeps
REQUEST = b"GET /health HTTP/1.1\r\nHost: paralon\r\n\r\n"


def test_a_connection_idle_for_as_long_as_the_client_keeps_it_still_answers(request, tmp_path):
    assert HTTP_IDLE_CONNECTION_KEPT_S > HTTPX_KEEPALIVE_EXPIRY_S
    with serving(migrated_database_url(request, "sqlite", tmp_path)) as serve:
        with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as conn:
            conn.sendall(REQUEST)
            assert _response(conn).startswith(b"HTTP/1.1 200")
            time.sleep(HTTPX_KEEPALIVE_EXPIRY_S + 1)  # idle past what the client would wait
            conn.sendall(REQUEST)
            assert _response(conn).startswith(b"HTTP/1.1 200"), "the server closed the idle connection"


def _response(conn: socket.socket) -> bytes:
    """One whole response (a body with a content-length), or what came before the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(4096)
        if not piece:
            return data
        data += piece
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        piece = conn.recv(4096)
        if not piece:
            break
        body += piece
    return head + b"\r\n\r\n" + body
