"""Runs llama-cpp-python's OpenAI-compatible server as a subprocess for tests."""
from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


class LlamaCppServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# With embeddings on, a llama-architecture model (the tiny one) would give a
# vector per token: mean pooling makes it one per input, as an embedding model does.
EMBEDDING_ARGS = ("--embedding", "True", "--kv_overrides", "llama.pooling_type=int:1")


def llamacpp_server_command(model_path: Path, model_alias: str, port: int, *, n_ctx: int,
                            interrupt_requests: bool, embedding: bool = False, extra_args: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "llama_cpp.server",
        "--model", str(model_path),
        "--model_alias", model_alias,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--n_ctx", str(n_ctx),
        "--interrupt_requests", str(interrupt_requests),
        *(EMBEDDING_ARGS if embedding else ()),
        *extra_args,
    ]


def wait_until_serving(process: subprocess.Popen, base_url: str, log_path: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LlamaCppServerError(
                f"llama.cpp server exited with code {process.returncode}:\n{log_path.read_text(errors='replace')}")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise LlamaCppServerError(f"llama.cpp server not ready at {base_url}:\n{log_path.read_text(errors='replace')}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def running_llamacpp_server(model_path: Path, model_alias: str, port: int | None = None, *,
                            n_ctx: int = 512, interrupt_requests: bool = False, embedding: bool = False,
                            startup_timeout: float = 60.0, extra_args: Sequence[str] = ()) -> Iterator[str]:
    """Serves ``model_path`` as ``model_alias`` on 127.0.0.1 and yields its base URL.

    ``interrupt_requests`` is off by default because the server's own default makes any
    request that arrives during a stream, even ``GET /v1/models``, cut that stream short.

    The server's output goes to a file rather than a pipe, so a chatty server never
    blocks on a full pipe; on a failed start the error carries that output.

    ``embedding`` starts it with embeddings on (``POST /v1/embeddings``), one vector per input.
    """
    port = port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = llamacpp_server_command(model_path, model_alias, port, n_ctx=n_ctx,
                                      interrupt_requests=interrupt_requests, embedding=embedding, extra_args=extra_args)
    with tempfile.TemporaryDirectory(prefix="llamacpp-server-") as log_dir:
        log_path = Path(log_dir) / "server.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_serving(process, base_url, log_path, time.monotonic() + startup_timeout)
            yield base_url
        finally:
            stop(process)
