"""`make run` (`paralon up`) prints its welcome only once the port accepts
connections: the moment the banner's first line appears, a connection to the
port succeeds and the printed curl example answers, each tried once."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

from pathlib import Path

import httpx
import pytest

from tests.support.harness import free_port

SOURCE_ROOT = str(Path(__file__).resolve().parents[3])  # this checkout's code, whatever the working directory

BANNER = "Paralon is running on"
END_OF_BANNER = "Stop: Ctrl-C"
STOP_WAIT_S = 20


@pytest.fixture
def up_process(tmp_path):
    """`paralon up` in a process group of its own (it and its simulated workers), stopped whole at the end."""
    port, workers = free_port(), (free_port(), free_port())
    env = {**os.environ, "PARALON_DATABASE_URL": f"sqlite:///{tmp_path}/var/paralon.db", "PYTHONPATH": SOURCE_ROOT}
    with open(tmp_path / "stderr.log", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", "from app.cli import main; main()", "up", "--port", str(port),
             "--worker-ports", str(workers[0]), str(workers[1])],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    try:
        yield process, port
    finally:
        _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C: up stops its simulated workers
        process.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever of the group is left
    except ProcessLookupError:
        pass
    process.wait()


def _read_until(process: subprocess.Popen, marker: str, lines: list[str]) -> None:
    while not lines or marker not in lines[-1]:
        line = process.stdout.readline()
        assert line, f"paralon up ended before printing {marker!r}: {''.join(lines)}"
        lines.append(line)


def _curl_example(printed: str) -> str:
    """The curl command as printed, its continuation lines joined."""
    start = printed.index("  curl ")
    end = printed.index("\n\n", start)
    return printed[start:end].replace("\\\n", " ").strip()


def test_the_banner_appears_once_the_port_accepts_and_its_example_works_at_once(up_process, tmp_path):
    process, port = up_process
    lines: list[str] = []
    _read_until(process, BANNER, lines)
    with socket.create_connection(("127.0.0.1", port)):  # once, no retry: the server listens already
        pass
    _read_until(process, END_OF_BANNER, lines)
    printed = "".join(lines)
    assert f"{BANNER} http://127.0.0.1:{port}" in printed and printed.count(BANNER) == 1
    command = _curl_example(printed)
    assert re.match(rf"curl http://127\.0\.0\.1:{port}/v1/chat/completions ", command)
    ran = subprocess.run(["sh", "-c", command + " --silent --show-error"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=STOP_WAIT_S)  # curl tries once unless told --retry
    assert ran.returncode == 0, ran.stderr
    answer = json.loads(ran.stdout)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0


def test_the_banner_prints_a_console_sign_in_link_for_the_demo_customer_and_owner(up_process):
    """No mail server here: the links are printed, and each signs its person in once."""
    process, port = up_process
    lines: list[str] = []
    _read_until(process, END_OF_BANNER, lines)
    printed = "".join(lines)
    links = dict(re.findall(rf"as the demo (customer|owner): (http://127\.0\.0\.1:{port}/console/sign-in/\S+)", printed))
    assert set(links) == {"customer", "owner"}
    homes = {}
    for who, link in links.items():
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", follow_redirects=False) as browser:
            confirm = browser.get(link)
            token = re.search(r'name="csrf_token" value="([^"]+)"', confirm.text).group(1)
            signed_in = browser.post(link, data={"csrf_token": token, "next": "/console"})
            assert signed_in.status_code == 302 and "paralon_session" in signed_in.cookies
            homes[who] = browser.get(browser.get("/console").headers["location"]).headers["location"]
            assert browser.post(link, data={"csrf_token": token}).status_code == 400  # used once
    assert homes["customer"].endswith("/overview") and homes["owner"].endswith("/earnings")
