"""An idle client connection outlives the client's own keep-alive.

The `openai` SDK (httpx) keeps an idle connection 5 s; uvicorn closed them at
5 s too. A request sent on a pooled connection just as the server's timer
closed it was reset, and the caller saw a `ReadError` with nothing relayed.
The server now keeps idle connections for longer than its clients do, so the
client is the one that closes them."""
from __future__ import annotations

import http.client
import time

from app.limits import HTTP_IDLE_CONNECTION_KEPT_S
from tests.conftest import migrated_database_url
from tests.support.harness import serving

HTTPX_KEEPALIVE_EXPIRY_S = 5.0  # httpx's default, which the `openai` SDK keeps


def test_a_connection_idle_for_as_long_as_the_client_keeps_it_still_answers(request, tmp_path):
    assert HTTP_IDLE_CONNECTION_KEPT_S > HTTPX_KEEPALIVE_EXPIRY_S
    with serving(migrated_database_url(request, "sqlite", tmp_path)) as serve:
        conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=30)
        try:
            assert _health(conn) == 200
            first_socket = conn.sock
            time.sleep(HTTPX_KEEPALIVE_EXPIRY_S + 1)  # idle past what the client would wait
            # On a connection the server has closed, this raises RemoteDisconnected (http.client
            # opens a new one only when it closed the last itself).
            assert _health(conn) == 200 and conn.sock is first_socket
        finally:
            conn.close()


def _health(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    return response.status
