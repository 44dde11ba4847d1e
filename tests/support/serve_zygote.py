"""Forks `paralon serve` processes for one test process, with the heavy
third-party libraries already imported: importing them took most of the
second and a half of CPU each of the suite's few hundred `serve` starts cost,
on two cores that the suite keeps busy.

Run by tests/support/serve_forks.py as a script, never imported. Only
third-party libraries are loaded here: none of them reads Paralon's settings,
while the project's own modules (some read the environment as they import)
are imported by each child, under its own environment, as a fresh process
would. One JSON request per line on stdin, one JSON answer per line on stdout:
  {"op": "spawn", "argv": [...], "env": {...}, "cwd": "...", "log": "..."} -> {"pid": n}
  {"op": "status", "pid": n} -> {"code": null while it runs, else as Popen.returncode}
At the end of stdin (the test process ended, however it ended) every child
still running is killed with its process group, and the zygote exits.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import sys
import traceback

PRELOADED = ("sqlalchemy", "sqlalchemy.dialects.postgresql", "sqlalchemy.dialects.sqlite", "psycopg", "alembic",
             "litestar", "litestar.openapi", "litestar.contrib.jinja", "jinja2", "msgspec", "pydantic", "pydantic_settings",
             "uvicorn", "uvicorn.protocols.http.httptools_impl", "uvloop", "httptools", "httpx", "anyio", "orjson", "click",
             "prometheus_client", "celery", "celery.app", "celery.schedules", "kombu", "amqp", "billiard", "redis", "stripe",
             "dateutil", "tzlocal", "segno", "smtplib", "statistics", "concurrent.futures")

_exit_codes: dict[int, int] = {}  # reaped children: pid -> exit code, as Popen.returncode
_running: set[int] = set()


def _reap(*_) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _running.discard(pid)
        _exit_codes[pid] = os.waitstatus_to_exitcode(status)


def _run_child(request: dict) -> None:
    """In the forked child: its own session and output, the caller's environment, then the command."""
    code = 1
    try:
        os.setsid()  # a process group of its own, as Popen(start_new_session=True) gives
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = ["paralon", *request["argv"]]
        sys.path[0] = ""  # as `python -c`: the working directory first
        from app.cli import main

        main(request["argv"], prog_name="paralon")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # what the interpreter would run at exit; the zygote's own loop is not returned to
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _answer(request: dict) -> dict:
    if request["op"] == "spawn":
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        _running.add(pid)
        return {"pid": pid}
    _reap()
    return {"code": _exit_codes.get(request["pid"])}


def main() -> None:
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = ""  # not this folder's modules: they would shadow libraries of the same names
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed here: the child imports what it needs
            pass
    signal.signal(signal.SIGCHLD, _reap)
    for line in sys.stdin:
        sys.stdout.write(json.dumps(_answer(json.loads(line))) + "\n")
        sys.stdout.flush()
    for pid in list(_running):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap()


if __name__ == "__main__":
    main()
