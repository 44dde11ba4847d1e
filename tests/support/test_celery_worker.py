"""The `celery_worker` fixture: workers never share tasks, and a failing test
still stops its worker and everything the worker forked."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.celery_worker import celery_worker  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]
NOT_CONFIGURED = {"skipped": "crypto deposits are not configured"}
TASKS_PER_WORKER = 3

FAILING_TEST = """
import os

from tests.support.celery_worker import celery_worker  # noqa: F401
from tests.support.services import redis_url  # noqa: F401


def test_fails_while_its_worker_runs(celery_worker, tmp_path):
    worker = celery_worker({"PARALON_DATABASE_URL": f"sqlite:///{tmp_path}/unused.db"})
    assert worker.result(worker.send("paralon.crypto_scan"))["skipped"]
    with open(os.environ["GROUP_FILE"], "w") as out:
        out.write(str(os.getpgid(worker.process.pid)))
    raise AssertionError("this test fails on purpose")
"""


def _env(tmp_path: Path) -> dict[str, str]:
    return {"PARALON_DATABASE_URL": f"sqlite:///{tmp_path}/unused.db"}  # the task used connects to no database


def test_two_workers_never_take_each_others_tasks(celery_worker, tmp_path):
    first, second = celery_worker(_env(tmp_path)), celery_worker(_env(tmp_path))
    sent = {worker.key_prefix: [worker.send("paralon.crypto_scan") for _ in range(TASKS_PER_WORKER)] for worker in (first, second)}
    for worker in (first, second):
        assert [worker.result(one) for one in sent[worker.key_prefix]] == [NOT_CONFIGURED] * TASKS_PER_WORKER
    for worker, other in ((first, second), (second, first)):
        log = worker.log_path.read_text()
        assert log.count("] received") == TASKS_PER_WORKER, log
        assert not any(one.id in log for one in sent[other.key_prefix]), "a task sent to the other worker ran here"


def test_a_failing_test_still_stops_its_worker_and_its_children(tmp_path):
    (tmp_path / "test_inner.py").write_text(FAILING_TEST)
    group_file = tmp_path / "group"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "GROUP_FILE": str(group_file)}
    inner = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path / "test_inner.py")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert inner.returncode == 1 and "this test fails on purpose" in inner.stdout, inner.stdout + inner.stderr
    group = int(group_file.read_text())
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return
    raise AssertionError(f"process group {group} of the worker is still running")
