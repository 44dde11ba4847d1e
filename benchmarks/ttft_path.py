"""Where the proxy's part of the time to the first token goes, step by step.

One caller streams one short request after another (nothing else running,
so no step waits behind another request) through `paralon serve` to a
simulated worker, then straight to the worker. Both processes run with
marks (benchmarks/ttft_marks/sitecustomize.py) at each step of a request:
uvicorn has read it, the key is being checked, the proxy opens it (holds,
routes), the request goes to the worker, the worker has it, the first token
is read, the first byte is sent to the caller. The marks share the system's
monotonic clock, so the steps of both processes line up.

    python benchmarks/ttft_path.py --json

Prints one JSON line: the median and p90 of each step in ms, their sum before
the worker has the request and after the first token is read, and the time
to the first token added over the direct path (p50). A mark costs about a
µs (kept in memory, written four times a second), which the steps include.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKS_DIR = tempfile.mkdtemp(prefix="paralon_ttft_marks_")
MARKS = MARKS_DIR + "/marks"
# Set before the harness starts its processes, which inherit it.
os.environ["PARALON_TTFT_MARKS"] = MARKS
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE / "ttft_marks"), str(HERE.parent), os.environ.get("PYTHONPATH", "")])

sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from proxy_overhead import percentile, run_phase  # noqa: E402
from scratch import ScratchDatabase, log  # noqa: E402
from tests.support.db_roles import drop_app_role  # noqa: E402
from tests.support.harness import ServeProcess, SimWorkerProcess, make_fleet  # noqa: E402

TOKENS_PER_REQUEST = 16
FLUSH_WAIT_S = 1.0  # four times the marks' flush interval (ttft_marks/sitecustomize.py)
WARM_UP_REQUESTS = 5
# The steps in the order a request takes them: (process, mark) pairs, the
# worker's first request mark being the request as the worker reads it.
STEPS = [("proxy", "request_arrived"), ("proxy", "request_read"), ("proxy", "authenticating"), ("proxy", "proxy_opening"),
         ("proxy", "upstream_sent"), ("worker", "request_arrived"), ("proxy", "first_token_read"), ("proxy", "proxy_opened"),
         ("proxy", "body_sent")]
BEFORE_WORKER = (("proxy", "request_arrived"), ("worker", "request_arrived"))
AFTER_FIRST_TOKEN = (("proxy", "first_token_read"), ("proxy", "body_sent"))


def read_marks(serve_pid: int) -> list[dict]:
    """Per request, the first time of each (process, mark), in the order the proxy received them."""
    marks = []
    for path in glob.glob(MARKS + ".*"):
        with open(path) as f:
            marks += [(float(t), int(pid), name) for pid, name, t in (line.split() for line in f)]
    requests, current = [], None
    for at, pid, name in sorted(marks):
        process = "proxy" if pid == serve_pid else "worker"
        if (process, name) == ("proxy", "request_arrived"):
            current = {}
            requests.append(current)
        if current is not None:
            current.setdefault((process, name), at)
    return [r for r in requests if all(step in r for step in STEPS)][WARM_UP_REQUESTS:]


def step_ms(requests: list[dict], start, end) -> dict:
    spans = [(r[end] - r[start]) * 1000 for r in requests]
    return {"p50": round(statistics.median(spans), 3), "p90": round(percentile(spans, 0.9), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    worker = SimWorkerProcess("h200").start()
    try:
        with ScratchDatabase(args.database_url, "paralon_ttftpath") as scratch:
            url = scratch.url.render_as_string(hide_password=False)
            fleet = make_fleet(url, [worker.url], credits_usd="100000")
            proxy = ServeProcess(url, PARALON_HEALTH_INTERVAL_MS="2000", PARALON_KEY_CACHE_TTL_MS="1000").start()
            try:
                path = "/v1/chat/completions"
                log("one caller through the proxy, then straight to the worker ...")
                proxy_ttfts = asyncio.run(run_phase(proxy.url + path, {"authorization": f"Bearer {fleet.key}"}, 1, args.seconds,
                                                    TOKENS_PER_REQUEST))[0]
                direct_ttfts = asyncio.run(run_phase(worker.url + path, {}, 1, args.seconds,
                                                     TOKENS_PER_REQUEST))[0]
                time.sleep(FLUSH_WAIT_S)  # the marks still in memory are written
                requests = read_marks(proxy.process.pid)
            finally:
                proxy.stop()
            fleet.engine.dispose()
    finally:
        worker.stop()
        drop_app_role()
        shutil.rmtree(MARKS_DIR, ignore_errors=True)
    if not requests:
        raise SystemExit("no request carried every mark: were the marks loaded (PYTHONPATH)?")
    result = {
        "steps_ms": {f"{':'.join(a)} -> {':'.join(b)}": step_ms(requests, a, b) for a, b in zip(STEPS, STEPS[1:])},
        "until_the_worker_has_it_ms": step_ms(requests, *BEFORE_WORKER),
        "after_the_first_token_ms": step_ms(requests, *AFTER_FIRST_TOKEN),
        "ttft_added_ms_p50": round(statistics.median(proxy_ttfts) - statistics.median(direct_ttfts), 3),
        "requests": len(requests),
    }
    print(json.dumps(result, sort_keys=True) if args.json else json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
