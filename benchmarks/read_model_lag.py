"""How far the read models trail the log under load, against a real `paralon serve`.

1,000 chat completions (16 callers, a simulated worker that answers at once)
go through one `serve` whose follower applies the read models (nothing else
does). Every 0.1 s the lag is sampled as operators see it at /metrics: the age
of the oldest event not applied (`paralon_projection_lag_seconds`) and the
events not applied. Printed: lag p50/p99/max during the load, the max as a
ratio to the bound (READ_MODELS_LAG_S_MAX, 5 s), events applied per second
during the load as a ratio to events appended (1.0: it keeps pace), and as a
ratio to a rebuild of the same log with nothing else running (the share of
the applier's capacity the load used), then the time to catch up after it.

    python benchmarks/read_model_lag.py --json

The database in the URL is only used to create (and finally drop) a scratch
database of the benchmark's own.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import func, select  # noqa: E402

from app.limits import READ_MODELS_LAG_S_MAX  # noqa: E402
from invoices import read_models  # noqa: E402
from ledger.log import consumer_position  # noqa: E402
from ledger.schema import ledger_events  # noqa: E402
from scratch import ScratchDatabase, log  # noqa: E402
from tests.support.db_roles import drop_app_role  # noqa: E402
from tests.support.harness import MODEL, ServeProcess, free_port, make_fleet, wait_for  # noqa: E402

SAMPLE_INTERVAL_S = 0.1
CAUGHT_UP_WAIT_S = 120
WORKER_START_S = 60


def start_worker(port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", "from app.cli import main; main()", "sim-worker", "--port", str(port),
                                "--profile", "instant", "--model", MODEL], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _answers(f"http://127.0.0.1:{port}/health"), timeout_s=WORKER_START_S)
    return process


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def head_and_position(engine) -> tuple[int, int]:
    with engine.connect() as conn:
        head = conn.execute(select(func.coalesce(func.max(ledger_events.c.seq), 0))).scalar_one()
        return head, consumer_position(conn, read_models.CONSUMER)


class Sampler(threading.Thread):
    def __init__(self, engine) -> None:
        super().__init__(name="lag-sampler")
        self.engine, self.done = engine, threading.Event()
        self.lag_s: list[float] = []
        self.lag_events: list[int] = []

    def run(self) -> None:
        while not self.done.wait(SAMPLE_INTERVAL_S):
            self.lag_s.append(read_models.lag_seconds(self.engine))
            self.lag_events.append(read_models.lag_events(self.engine))


async def load(url: str, key: str, requests: int, callers: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    queue = iter(range(requests))
    async with httpx.AsyncClient(timeout=60, headers={"authorization": f"Bearer {key}"}) as client:
        async def caller() -> None:
            for _ in queue:
                response = await client.post(f"{url}/v1/chat/completions", json=body)
                response.raise_for_status()
        await asyncio.gather(*(caller() for _ in range(callers)))


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--requests", type=int, default=1_000)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    worker_port = free_port()
    worker = start_worker(worker_port)
    try:
        with ScratchDatabase(args.database_url, "paralon_lagbench") as scratch:
            url = scratch.url.render_as_string(hide_password=False)
            fleet = make_fleet(url, [f"http://127.0.0.1:{worker_port}"], credits_usd="100000")
            proxy = ServeProcess(url).start()
            try:
                wait_for(lambda: read_models.lag_events(fleet.engine) == 0, timeout_s=CAUGHT_UP_WAIT_S)
                log(f"{args.requests} requests, {args.callers} callers, through one serve ...")
                sampler = Sampler(fleet.engine)
                head_before, position_before = head_and_position(fleet.engine)
                sampler.start()
                started = time.perf_counter()
                try:
                    asyncio.run(load(proxy.url, fleet.key, args.requests, args.callers))
                finally:
                    load_s = time.perf_counter() - started
                    head_after, position_after = head_and_position(fleet.engine)
                    sampler.done.set()
                    sampler.join()
                wait_for(lambda: read_models.lag_events(fleet.engine) == 0, timeout_s=CAUGHT_UP_WAIT_S, interval_s=0.01)
                caught_up_s = time.perf_counter() - started - load_s
            finally:
                proxy.stop()
            log("rebuilding the read models alone, for the baseline ...")
            rebuild_started = time.perf_counter()
            rebuilt = read_models.rebuild(fleet.engine)
            rebuild_per_s = rebuilt / (time.perf_counter() - rebuild_started)
            settled = len(fleet.settlements())
            fleet.engine.dispose()
    finally:
        worker.terminate()
        worker.wait(10)
        drop_app_role()  # the role `serve` ran as (tests.support.db_roles), once its database is gone

    applied_per_s = (position_after - position_before) / load_s
    appended_per_s = (head_after - head_before) / load_s
    result = {
        "lag_s_p50": round(statistics.median(sampler.lag_s), 3),
        "lag_s_p99": round(percentile(sampler.lag_s, 0.99), 3),
        "lag_s_max": round(max(sampler.lag_s), 3),
        "lag_s_max_per_bound": round(max(sampler.lag_s) / READ_MODELS_LAG_S_MAX, 3),
        "lag_events_p50": statistics.median(sampler.lag_events),
        "lag_events_p99": percentile(sampler.lag_events, 0.99),
        "lag_events_max": max(sampler.lag_events),
        "applied_events_per_s": round(applied_per_s, 1),
        "appended_events_per_s": round(appended_per_s, 1),
        "applied_per_appended": round(applied_per_s / appended_per_s, 3) if appended_per_s else None,
        "rebuild_events_per_s": round(rebuild_per_s, 1),
        "applied_per_rebuild": round(applied_per_s / rebuild_per_s, 3),
        "caught_up_after_load_s": round(caught_up_s, 3),
        "load_s": round(load_s, 2),
        "requests_settled": settled,
        "samples": len(sampler.lag_s),
        "bound_s": READ_MODELS_LAG_S_MAX,
    }
    print(json.dumps(result, sort_keys=True) if args.json else "\n".join(f"{k}: {v}" for k, v in sorted(result.items())))


if __name__ == "__main__":
    main()
