"""A real `paralon worker` on the local Redis, for tests that need one.

Every worker gets a Redis key prefix of its own (queues, results, broadcasts),
so tests running at the same time, in other pytest-xdist processes or other
checkouts, never take each other's tasks. The worker runs in a process group
of its own, stopped with everything it forked when the test ends, passed or
failed. Import the `celery_worker` fixture into the test module that uses it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult


STOP_TIMEOUT_S = 20.0
RESULT_TIMEOUT_S = 90.0
LOG_TAIL_CHARS = 4_000
PREFIX_ENV = "PARALON_TEST_CELERY_KEY_PREFIX"

# `paralon worker`, with its broker and result keys under the test's prefix
# (a test setting, so it is set here rather than read by app.jobs.celery).
WORKER_PROGRAM = f"""
import os
from app.jobs.celery import celery
options = {{"global_keyprefix": os.environ["{PREFIX_ENV}"]}}
celery.conf.broker_transport_options = options
celery.conf.result_backend_transport_options = options
from app.cli import main
main()
"""


@dataclass
class CeleryWorker:
    process: subprocess.Popen
    client: Celery  # sends to the worker and reads what it reports
    key_prefix: str
    log_path: Path

    def send(self, task: str, *args, **kwargs) -> AsyncResult:
        return self.client.send_task(task, args=args, kwargs=kwargs)

    def result(self, sent: AsyncResult, timeout_s: float = RESULT_TIMEOUT_S):
        """What the task returned, once it has finished (retries included)."""
        try:
            return sent.get(timeout=timeout_s)
        except Exception as exc:
            raise AssertionError(f"task {sent.id} ({sent.state}): {exc!r}\n{self.log_tail()}") from exc

    def wait_for_states(self, sent: list[AsyncResult], state: str, timeout_s: float = RESULT_TIMEOUT_S) -> None:
        """Until the worker has reported every one of these tasks in `state` (e.g. RETRY)."""
        deadline = time.monotonic() + timeout_s
        while not all(one.state == state for one in sent):
            if time.monotonic() > deadline or self.process.poll() is not None:
                states = [one.state for one in sent]
                raise AssertionError(f"not every task reached {state}: {states}\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """The worker and every process it forked."""
        try:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
            self._signal(signal.SIGKILL)  # what did not stop in time, and any straggling child
            self.process.wait()
        finally:
            self.client.close()

    def _signal(self, signal_number: int) -> None:
        try:
            os.killpg(self.process.pid, signal_number)
        except ProcessLookupError:  # the whole group has exited
            pass

    def forget_keys(self, redis_url: str) -> None:
        client = redis.Redis.from_url(redis_url)
        try:
            for key in client.scan_iter(match=f"{self.key_prefix}*"):
                client.delete(key)
        finally:
            client.close()


def start_worker(env: dict[str, str], log_path: Path, redis_url: str, *, concurrency: int = 2,
                 pool: str = "prefork", extra_args: tuple[str, ...] = ()) -> CeleryWorker:
    prefix = f"paralon-test-{uuid.uuid4().hex[:12]}:"
    worker_env = {**os.environ, **env, "PARALON_CELERY_BROKER_URL": redis_url, "PARALON_CELERY_RESULT_URL": redis_url,
                  PREFIX_ENV: prefix}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", WORKER_PROGRAM, "worker", "--concurrency", str(concurrency), "--pool", pool,
             "--without-gossip", "--without-mingle", "--without-heartbeat", *extra_args],
            env=worker_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    options = {"global_keyprefix": prefix}
    client = Celery(broker=redis_url, backend=redis_url, set_as_current=False,
                    broker_transport_options=options, result_backend_transport_options=options)
    return CeleryWorker(process, client, prefix, log_path)


@pytest.fixture
def celery_worker(tmp_path, redis_url) -> Iterator:
    """start(env, concurrency=2, pool="prefork", extra_args=()) -> CeleryWorker; env holds what the
    worker needs besides the broker (PARALON_DATABASE_URL, ...); extra_args go to `paralon worker`."""
    started: list[CeleryWorker] = []

    def start(env: dict[str, str], **options) -> CeleryWorker:
        worker = start_worker(env, tmp_path / f"celery-worker-{len(started)}.log", redis_url, **options)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
        worker.forget_keys(redis_url)
