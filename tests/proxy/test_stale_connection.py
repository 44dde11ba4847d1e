"""A keep-alive connection the worker closed as the next request went out is
not a worker failure: on a model with one worker the request is sent again
on a new connection to the same worker, answered and billed once."""
from __future__ import annotations

import asyncio
import threading

import openai
import orjson

from tests.support.harness import MODEL, make_fleet, serving

COMPLETION = [" kept", " alive"]


def _sse_answer() -> bytes:
    chunks = [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
               "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]} for word in COMPLETION]
    chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [],
                   "usage": {"prompt_tokens": 7, "completion_tokens": len(COMPLETION), "total_tokens": 7 + len(COMPLETION)}})
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class RacingWorker:
    """Answers one generation per connection and keeps the connection alive,
    then closes it, unanswered, when the next generation arrives on it: the
    keep-alive timeout of uvicorn (which vLLM runs on) racing a request. It
    answers health checks like vLLM."""

    def __init__(self) -> None:
        self.generations_received = 0
        self.generations_answered = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "RacingWorker":
        self.thread.start()
        self.ready.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered_a_generation = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ")[:2]
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                if method == b"POST":
                    self.generations_received += 1
                    if answered_a_generation:
                        break  # the race: closed, never answered
                    answered_a_generation = True
                    self.generations_answered += 1
                writer.write(self._answer(path))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def _answer(self, path: bytes) -> bytes:
        if path == b"/v1/models":
            body, kind = orjson.dumps({"object": "list", "data": [{"id": MODEL, "max_model_len": 4096}]}), b"application/json"
        elif path.startswith(b"/v1/chat/completions"):
            body, kind = _sse_answer(), b"text/event-stream"
        else:
            body, kind = b"", b"text/plain"
        return b"HTTP/1.1 200 OK\r\ncontent-type: " + kind + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_stale_pooled_connection_is_retried_on_the_same_worker_and_billed_once(database_url):
    worker = RacingWorker().start()
    fleet = make_fleet(database_url, [worker.url])
    try:
        with serving(database_url) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0)
            before = fleet.balance(fleet.customer_id).balance_nano_usd
            answers = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                                                      max_tokens=8) for i in range(3)]
    finally:
        worker.stop()
    assert [a.choices[0].message.content for a in answers] == ["".join(COMPLETION)] * 3, "no 503 on a one-worker model"
    assert worker.generations_answered == 3 and worker.generations_received == 5, "two requests met a closed connection"
    charge = 7 * 150 + len(COMPLETION) * 600
    assert [s["charge_nano_usd"] for s in fleet.settlements()] == [charge] * 3, "each answer billed once"
    assert fleet.balance(fleet.customer_id).balance_nano_usd == before - 3 * charge
    fleet.assert_books_close()
