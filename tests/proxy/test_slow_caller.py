"""A caller that stops reading a long stream, through `paralon serve`: the
proxy writes each token to the caller from the worker's read callback, so it
must stop reading the worker while the caller is behind, not buffer the
stream. The worker is held back by TCP; once the caller reads, it gets every
chunk, in order, and is billed once, as reported."""
from __future__ import annotations

import socket
import threading
import time

import orjson

from tests.support.hand_written_worker import HandWrittenWorker
from tests.support.harness import MODEL, ThreadedServer, make_fleet, serving

CHUNKS = 1600
CONTENT = "z" * 65536  # 100 MB in all: more than every buffer between the worker and the caller
CALLER_RECEIVE_BUFFER_BYTES = 65536  # fixed, so that the kernel does not grow it while the caller does not read
STALL_S = 1.0  # the worker is taken as held back once it sent nothing for this long
STALL_WAIT_MAX_S = 60.0
READ_TIMEOUT_S = 60


class LongStreamWorker(HandWrittenWorker):
    """Streams CHUNKS chunks as fast as TCP lets it, counting those sent."""

    def __init__(self) -> None:
        super().__init__(self._long_answer)
        self.sent = 0
        self.finished = threading.Event()  # every chunk sent, [DONE] on its way

    def _long_answer(self, body: dict):
        for _ in range(CHUNKS):
            yield {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                   "choices": [{"index": 0, "delta": {"content": CONTENT}, "finish_reason": None}]}
            self.sent += 1  # the send before it returned: the chunk left
        yield {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
               "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        yield {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [],
               "usage": {"prompt_tokens": 9, "completion_tokens": CHUNKS}}
        self.finished.set()


def _wait_until_stalled(worker: LongStreamWorker) -> int:
    """How many chunks the worker sent once it stopped sending (or finished)."""
    deadline = time.monotonic() + STALL_WAIT_MAX_S
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline and not worker.finished.is_set():
        if worker.sent != last:
            last, since = worker.sent, time.monotonic()
        elif time.monotonic() - since >= STALL_S:
            break
        time.sleep(0.05)
    return worker.sent


def _read_all(sock: socket.socket) -> bytes:
    received = bytearray()
    while not received.endswith(b"0\r\n\r\n"):
        piece = sock.recv(1 << 20)
        assert piece, "the proxy closed the connection before the stream ended"
        received += piece
    return bytes(received)


def test_a_caller_that_stops_reading_holds_the_worker_back_and_then_gets_every_chunk_billed_once(postgres_url):
    worker = LongStreamWorker()
    server = ThreadedServer(worker).start()
    fleet = make_fleet(postgres_url, [server.url], credits_usd="100")
    try:
        with serving(postgres_url) as proxy:
            body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a long answer"}],
                                 "max_tokens": CHUNKS + 10, "stream": True})
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CALLER_RECEIVE_BUFFER_BYTES)
            sock.settimeout(READ_TIMEOUT_S)
            sock.connect(("127.0.0.1", proxy.port))
            with sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                             b"Authorization: Bearer " + fleet.key.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                sent_while_unread = _wait_until_stalled(worker)
                assert not worker.finished.is_set() and sent_while_unread < CHUNKS, \
                    "the proxy read the whole stream from the worker while its caller read nothing"
                received = _read_all(sock)
    finally:
        server.stop()
    assert worker.finished.is_set()
    assert received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert received.count(CONTENT.encode()) == CHUNKS, "every chunk arrived, whole"
    assert b"data: [DONE]" in received
    [settled] = fleet.settlements()
    assert settled["meta"]["completion_tokens"] == CHUNKS
    customer = fleet.balance(fleet.customer_id)
    assert customer.held_nano_usd == 0 and customer.balance_nano_usd == 100 * 10**9 - settled["charge_nano_usd"]
    fleet.assert_books_close()
