"""`paralon serve` started by fork from a zygote that has the heavy libraries
imported (tests/support/serve_zygote.py), behind the part of the Popen
interface the tests use: pid, poll, wait, terminate, kill, send_signal and
stdout (the process's output so far, from its log file).

One zygote per test process, started at the first `serve`; it ends, killing
whatever it started that is still running, when the test process does."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ZYGOTE_SCRIPT = Path(__file__).with_name("serve_zygote.py")
POLL_INTERVAL_S = 0.01
ZYGOTE_STOP_WAIT_S = 10.0


class Zygote:
    def __init__(self) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix="paralon-serve-logs-"))
        self._process = subprocess.Popen([sys.executable, str(ZYGOTE_SCRIPT)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()  # one request and its answer at a time, from any thread
        self._spawned = 0
        atexit.register(self.close)

    def request(self, **request) -> dict:
        with self._lock:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError("the serve zygote exited")
        return json.loads(answer)

    def spawn(self, argv: list[str], env: dict[str, str]) -> "ForkedProcess":
        with self._lock:
            self._spawned += 1
            log = self.logs / f"serve-{self._spawned}.log"
        pid = self.request(op="spawn", argv=argv, env=env, cwd=os.getcwd(), log=str(log))["pid"]
        return ForkedProcess(self, pid, log, argv)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()  # the zygote kills what is left, then exits
            try:
                self._process.wait(ZYGOTE_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
        shutil.rmtree(self.logs, ignore_errors=True)


class ForkedProcess:
    def __init__(self, zygote: Zygote, pid: int, log: Path, argv: list[str]) -> None:
        self._zygote, self.pid, self._log, self.args = zygote, pid, log, argv
        self.returncode: int | None = None
        self._stdout = None

    @property
    def stdout(self):
        if self._stdout is None:
            self._log.touch()
            self._stdout = open(self._log, errors="replace")
        return self._stdout

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.request(op="status", pid=self.pid)["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(POLL_INTERVAL_S)
        return self.returncode

    def send_signal(self, signal_number: int) -> None:
        if self.poll() is None:  # never signal a pid that may have been reused
            try:
                os.kill(self.pid, signal_number)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def fork_serve(argv: list[str], env: dict[str, str]) -> ForkedProcess:
    """`paralon <argv>` (serve) in its own process group, with `env` as its whole environment."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = Zygote()
    return _zygote.spawn(argv, env)
