"""Marks on the way to the first token, for benchmarks/ttft_path.py only.

Loaded by every Python process that has this folder on PYTHONPATH and
PARALON_TTFT_MARKS set (a file prefix): `paralon serve` and the simulated
worker the benchmark starts. Each mark is a line "<pid> <name>
<perf_counter>" in <prefix>.<pid>; perf_counter is the system's monotonic
clock, the same in every process, so marks of the proxy and of the worker
line up.
"""
import functools
import os
import time

_PREFIX = os.environ.get("PARALON_TTFT_MARKS")


def _install(prefix: str) -> None:
    out = open(f"{prefix}.{os.getpid()}", "a", buffering=1)

    def mark(name: str) -> None:
        out.write(f"{os.getpid()} {name} {time.perf_counter():.6f}\n")

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
