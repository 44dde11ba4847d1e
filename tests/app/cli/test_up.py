"""`make run` (`paralon up`) on a fresh directory: the printed key and example work."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx
import openai
import pytest

from app.cli import up
from tests.support.harness import free_port, wait_for


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_up_serves_the_demo_and_the_printed_key_works(tmp_path):
    port, workers = free_port(), (free_port(), free_port())
    env = {**os.environ, "PARALON_DATABASE_URL": f"sqlite:///{tmp_path}/var/paralon.db",
           "PYTHONPATH": str(Path(__file__).resolve().parents[3])}  # this checkout's code, from any directory
    process = subprocess.Popen(
        [sys.executable, "-c", "from app.cli import main; main()", "up", "--port", str(port),
         "--worker-ports", str(workers[0]), str(workers[1])],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines: list[str] = []
        while not any("Stop: Ctrl-C" in line for line in lines):
            line = process.stdout.readline()
            assert line or process.poll() is None, "".join(lines)
            lines.append(line)
        printed = "".join(lines)
        key = re.search(r"API key \(shown once\): (sk-par-\S+)", printed).group(1)
        assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in printed
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/health"))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        answer = client.chat.completions.create(model="paralon-demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
        assert answer.usage.completion_tokens == 8 and float(answer.usage.model_extra["cost"]) > 0
        assert {m.id for m in client.models.list().data} == {"paralon-demo"}
        # No broker, so no `paralon beat`: `up` runs the schedule itself and the read models catch up.
        wait_for(lambda: re.search(r"paralon_projection_lag_events\{[^}]*\} 0(\.0)?\n",
                                   httpx.get(f"http://127.0.0.1:{port}/metrics").text) is not None, timeout_s=30)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(20)
    time.sleep(0.5)
    for worker_port in workers:  # the simulated workers stopped with it
        try:
            httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=0.5)
            raise AssertionError(f"a simulated worker still answers on {worker_port}")
        except httpx.ConnectError:
            pass


def test_a_simulated_worker_that_cannot_start_leaves_none_running(monkeypatch):
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs) -> subprocess.Popen:
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(up.subprocess, "Popen", popen)
    free, taken = free_port(), socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(click.ClickException, match="is in use"):
            up.start_sim_workers([("instant", free), ("instant", taken.getsockname()[1])])
    finally:
        taken.close()
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
                raise AssertionError("the simulated worker started first was left running")
    assert len(started) == 1
