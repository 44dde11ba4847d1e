"""A PostgreSQL server of a test's own, to crash with SIGKILL and start again.

The shared server must never be killed; this one lives in a temporary
directory, listens on a free port, and runs in a process group of its own,
so `crash()` takes the postmaster and every backend at once, and the
finaliser leaves nothing running. A SIGKILL loses the WAL still in the
server's shared buffers, not what was written to the kernel: with the WAL
writer asleep for 10 s between rounds, what a crash keeps is in practice what
a commit wrote and flushed itself (a commit's last WAL page is rarely written
by anyone else), not what the background happened to write. A test killed
itself (kill -9 of pytest) leaves the server running in its own session.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psycopg

from tests.support.faults import kill_hard
from tests.support.harness import free_port

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_SETTINGS = {"listen_addresses": "127.0.0.1", "wal_writer_delay": "10000", "fsync": "on", "synchronous_commit": "on",
             "max_connections": "40", "shared_buffers": "32MB"}


def server_binaries() -> Path | None:
    """The directory of this machine's `initdb` and `postgres`, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PrivatePostgres:
    def __init__(self, root: Path) -> None:
        binaries = server_binaries()
        if binaries is None:
            raise RuntimeError("no PostgreSQL server binaries (initdb, postgres) on this machine")
        self._binaries, self._root = binaries, root
        self._data, self._sockets = root / "data", root / "sockets"
        self.port = free_port()
        # initdb and postgres refuse to run as root: then they run as the postgres user.
        self._user = "postgres" if os.geteuid() == 0 else None
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def create(self) -> "PrivatePostgres":
        self._sockets.mkdir(parents=True)
        if self._user:
            shutil.chown(self._root, self._user)
            shutil.chown(self._sockets, self._user)
        subprocess.run([str(self._binaries / "initdb"), "-D", str(self._data), "-U", "postgres", "--auth=trust",
                        "--no-sync", "-E", "UTF8"], check=True, capture_output=True, user=self._user)
        return self.start()

    def start(self) -> "PrivatePostgres":
        settings = [arg for name, value in _SETTINGS.items() for arg in ("-c", f"{name}={value}")]
        self._process = subprocess.Popen(
            [str(self._binaries / "postgres"), "-D", str(self._data), "-p", str(self.port), "-k", str(self._sockets), *settings],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, user=self._user)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the private PostgreSQL server did not start") from None
                time.sleep(0.1)

    def crash(self) -> None:
        """SIGKILL the postmaster and every backend at once, as a power cut would leave them."""
        if self._process is not None:
            kill_hard(self._process)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGINT)  # PostgreSQL's fast shutdown: clients are not waited for
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                kill_hard(self._process)
        shutil.rmtree(self._root, ignore_errors=True)
