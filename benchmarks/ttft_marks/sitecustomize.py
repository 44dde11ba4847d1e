"""Marks on the way to the first token, for benchmarks/ttft_path.py only.

Loaded by every Python process that has this folder on PYTHONPATH and
PARALON_TTFT_MARKS set (a file prefix): `paralon serve` and the simulated
worker the benchmark starts. Each mark is a line "<pid> <name>
<perf_counter>" in <prefix>.<pid>; perf_counter is the system's monotonic
clock, the same in every process, so marks of the proxy and of the worker
line up. A mark is kept in memory and written with others four times a
second by a thread of its own: a write per mark, a system call, cost more
than some of the steps it marks. What is still in memory when the process
is killed is lost, the benchmark's last requests, which it leaves out.
"""
import functools
import os
import threading
import time
from collections import deque

_PREFIX = os.environ.get("PARALON_TTFT_MARKS")
FLUSH_INTERVAL_S = 0.25


def _install(prefix: str) -> None:
    pending: deque = deque()  # appended and taken from two threads: a deque's ends are safe for that

    def flush_forever() -> None:
        path = f"{prefix}.{os.getpid()}"
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            taken = [pending.popleft() for _ in range(len(pending))]
            if taken:
                with open(path, "a") as out:
                    out.write("".join(f"{os.getpid()} {name} {at:.6f}\n" for name, at in taken))

    def start_flushing() -> None:
        pending.clear()  # a forked child starts with its parent's marks, which are the parent's to write
        threading.Thread(target=flush_forever, name="ttft-marks", daemon=True).start()

    start_flushing()
    os.register_at_fork(after_in_child=start_flushing)  # `serve` is forked, and a fork keeps no thread

    def mark(name: str) -> None:
        pending.append((name, time.perf_counter()))

    def on_call(cls, method: str, name: str) -> None:
        original = getattr(cls, method)

        @functools.wraps(original)
        def marked(*args, **kwargs):
            mark(name)
            return original(*args, **kwargs)
        setattr(cls, method, marked)

    def around(cls, method: str, before: str | None, after: str | None) -> None:
        original = getattr(cls, method)

        @functools.wraps(original)
        async def marked(*args, **kwargs):
            if before:
                mark(before)
            try:
                return await original(*args, **kwargs)
            finally:
                if after:
                    mark(after)
        setattr(cls, method, marked)

    from uvicorn.protocols.http import httptools_impl
    on_call(httptools_impl.HttpToolsProtocol, "on_message_begin", "request_arrived")
    on_call(httptools_impl.HttpToolsProtocol, "on_message_complete", "request_read")
    send = httptools_impl.RequestResponseCycle.send

    async def marked_send(self, message):
        if message.get("type") == "http.response.body" and message.get("body"):
            mark("body_sent")
        return await send(self, message)
    httptools_impl.RequestResponseCycle.send = marked_send
    from app.http.chunk_writers import ChunkWriter
    on_call(ChunkWriter, "write", "body_sent")  # the relay's chunks bypass `send` under `paralon serve`
    from proxy.directory import Directory
    from proxy.generation import Generation
    from proxy.service import InferenceProxy
    from proxy.upstream import UpstreamPool
    around(Directory, "authenticate", "authenticating", None)
    around(InferenceProxy, "open", "proxy_opening", "proxy_opened")
    around(UpstreamPool, "_send", "upstream_sent", None)
    around(Generation, "read_to_first_token", None, "first_token_read")


if _PREFIX:
    _install(_PREFIX)
