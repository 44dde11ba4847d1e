"""The durable writer's CPU per settlement (or the holds' writer's per hold), this checkout against another revision, batch for batch.

On a shared machine the speed drifts by a third within minutes, more than a
change to the writer's Python moves it, so two whole benchmark runs cannot
tell them apart. Here two processes, one running this checkout's ledger and
one the other revision's (a temporary git worktree), each on its own scratch
database, take turns: one batch of settlements each, alternately first. Each
reports two CPU times for the batch (`append_batch` in one transaction): its
thread's (the writer's Python and its driver's) and, when the server is on
this machine, its database backend's (the statements, triggers and commit).
Each pair of neighbouring batches gives a ratio of each; drift moves both
sides alike.

    python benchmarks/append_ab.py --base HEAD~1 --json
    python benchmarks/append_ab.py --base HEAD --postings-in-event-row --json
    python benchmarks/append_ab.py --base HEAD --postings-in-event-row --base-postings-in-event-row --json
    python benchmarks/append_ab.py --base HEAD~1 --batch-size 1 --batches 3000 --durable --json
    python benchmarks/append_ab.py --base HEAD~1 --holds --batch-size 1 --batches 3000 --json

The second compares the two postings layouts of this checkout (migration
0031): this checkout with postings in their event's row, the base with rows.
The third compares uncommitted changes with both sides in the event-row layout.
The fourth runs each batch as the durable writer does (its transaction begun
with its first statement, the COMMIT and the wait for the flush in one
query), alone, as the proxy's settlements are at a few a millisecond. The
fifth places holds instead, each batch one call of the hold placement as the
holds' writer makes it (in autocommit), here of one hold: what a call costs
before its holds, as the proxy's calls are at a few requests a millisecond.

Prints one JSON line: the medians of each side and of the ratios (this
checkout over the base: below 1 is less CPU), for the writer's thread and for
the database's backend.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from checkout import REPO, revision_checkout

CUSTOMERS, OWNERS, HOLD_NANO_USD = 64, 8, 5_000_000


def worker(root: str, database_url: str, batches: int, batch_size: int, warm_up_batches: int, in_event_row: bool,
           durable: bool, holds: bool) -> None:
    """One side: settle (or place holds for) `batches` batches from `root`'s ledger, one per line
    read, printing CPU µs per command of the writer's thread and of its database backend."""
    sys.path[:0] = [root, str(Path(root) / "benchmarks")]  # its own scratch.py, which puts its own root first again
    if hasattr(os, "sched_setaffinity"):  # both sides on the same core: neither gets the quieter one
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from scratch import ScratchDatabase  # after the path: it names which ledger

    from app.runtime import tune_garbage_collector
    from ledger import commands as cmd
    from ledger.holds import PlaceHold, place_holds
    from ledger.db import storage_of
    from ledger.service import Ledger
    from ledger.store import append_batch

    with ScratchDatabase(database_url, "paralon_append_ab") as scratch:
        engine = scratch.engine()
        if in_event_row:
            from ledger.store import set_postings_in_event_row

            with engine.begin() as conn:
                set_postings_in_event_row(conn, True)
        ledger = Ledger(engine)
        customers = [ledger.create_account(cmd.CUSTOMER, f"ab customer {i}") for i in range(CUSTOMERS)]
        owners = [ledger.create_account(cmd.OWNER, f"ab owner {i}") for i in range(OWNERS)]
        for customer in customers:
            ledger.append(cmd.GrantCredits(customer, 10**15, "benchmark credits", f"grant:{customer}"))

        def settlements(batch: int) -> list:
            placed = [ledger.holder.submit(PlaceHold(customers[i % CUSTOMERS], HOLD_NANO_USD, f"h:{batch}:{i}")) for i in range(batch_size)]
            return [cmd.SettleRequest(h.result().hold_id, owners[i % OWNERS], 150 * (900 + i % 97), f"req:{batch}:{i}", f"s:{batch}:{i}",
                                      {"model": "bench", "prompt_tokens": 900 + i % 97}) for i, h in enumerate(placed)]

        prepared = [] if holds else [settlements(b) for b in range(warm_up_batches + batches)]
        ledger.close()
        tune_garbage_collector()
        storage = storage_of(engine)

        def append(conn, batch: int) -> list:
            with conn.begin():
                if not durable:
                    return append_batch(conn, prepared[batch], closing_keys_to_the_index=True)
                storage.begin_durable_batch(conn)
                results = append_batch(conn, prepared[batch], closing_keys_to_the_index=True)
                if hasattr(storage, "commit_durable_batch"):
                    storage.commit_durable_batch(conn, wait_for_flush=True)
                else:  # a revision before its name
                    storage.commit_and_wait_for_flush(conn)
                return results

        def place(conn, batch: int) -> list:
            results = place_holds(conn, [PlaceHold(customers[(batch * batch_size + i) % CUSTOMERS], HOLD_NANO_USD, f"h:{batch}:{i}")
                                         for i in range(batch_size)])
            conn.commit()
            return results

        run = place if holds else append
        # The durable writer's connection is in autocommit: it sends its own BEGIN with its first
        # statement; the holds' writer's too: its one statement is its transaction.
        with engine.connect() as conn:
            if durable or holds:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            backend_pid = conn.connection.driver_connection.info.backend_pid
            for batch in range(warm_up_batches):
                run(conn, batch)
            print(f"ready {Path(append_batch.__code__.co_filename).resolve()}", flush=True)
            for batch in range(warm_up_batches, warm_up_batches + batches):
                sys.stdin.readline()
                started, backend_started = time.thread_time(), backend_cpu_s(backend_pid)
                results = run(conn, batch)
                cpu_s, backend_s = time.thread_time() - started, backend_cpu_s(backend_pid) - backend_started
                if any(getattr(r, "status", None) != "created" for r in results):
                    raise SystemExit(f"a command of the batch was not created: {results[0]!r}")
                print(cpu_s / batch_size * 1e6, backend_s / batch_size * 1e6, flush=True)
        engine.dispose()


def backend_cpu_s(pid: int) -> float:
    """CPU seconds a local server process has run (Linux schedstat, nanoseconds); NaN where it cannot be read."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except OSError:
        return float("nan")


def compare(base: str, database_url: str, batches: int, batch_size: int, warm_up_batches: int, in_event_row: bool,
            base_in_event_row: bool = False, durable: bool = False, holds: bool = False) -> dict:
    with revision_checkout(base) as base_root:
        sides: dict[str, subprocess.Popen] = {}
        try:
            for name, root in (("base", base_root), ("current", str(REPO))):
                sides[name] = subprocess.Popen(
                    [sys.executable, __file__, "--worker", root, "--database-url", database_url, "--batches", str(batches),
                     "--batch-size", str(batch_size), "--warm-up-batches", str(warm_up_batches), *(["--durable"] if durable else []), *(["--holds"] if holds else []),
                     *(["--postings-in-event-row"] if (in_event_row if name == "current" else base_in_event_row) else [])],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
            for (name, process), root in zip(sides.items(), (base_root, str(REPO))):
                ready = process.stdout.readline().split(maxsplit=1)
                if len(ready) != 2 or ready[0] != "ready" or not Path(ready[1].strip()).is_relative_to(Path(root).resolve()):
                    raise SystemExit(f"the {name} side did not start on its own checkout: {ready}")
            cpu_us: dict[str, list[float]] = {name: [] for name in sides}
            backend_us: dict[str, list[float]] = {name: [] for name in sides}
            for turn in range(batches):
                order = list(sides) if turn % 2 == 0 else list(reversed(sides))
                for name in order:
                    sides[name].stdin.write("go\n")
                    sides[name].stdin.flush()
                    line = sides[name].stdout.readline()
                    if not line:
                        raise SystemExit(f"the {name} side ended after {turn} batches")
                    thread, backend = map(float, line.split())
                    cpu_us[name].append(thread)
                    backend_us[name].append(backend)
        finally:
            for process in sides.values():
                if process.stdin:
                    process.stdin.close()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
    unit = "hold" if holds else "settlement"
    return {"base": base, "batches": batches, "batch_size": batch_size, "postings_in_event_row": in_event_row,
            "base_postings_in_event_row": base_in_event_row, "durable": durable, "holds": holds,
            **side_by_side("", cpu_us, unit), **side_by_side("backend_", backend_us, unit)}


def side_by_side(prefix: str, cpu_us: dict[str, list[float]], unit: str) -> dict:
    """Each side's median CPU per command (`unit`), and the median and quartiles of the batch-by-batch ratios."""
    ratios = [current / base_us for base_us, current in zip(cpu_us["base"], cpu_us["current"])]
    if any(math.isnan(r) for r in ratios):  # the server is not on this machine
        return {}
    return {
        f"base_{prefix}cpu_us_per_{unit}_median": round(statistics.median(cpu_us["base"]), 2),
        f"current_{prefix}cpu_us_per_{unit}_median": round(statistics.median(cpu_us["current"]), 2),
        f"current_to_base_{prefix}ratio_median": round(statistics.median(ratios), 3),
        f"current_to_base_{prefix}ratio_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision to compare this checkout with (HEAD: its uncommitted changes)")
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=400, help="settlements per batch (the throughput run's mean is about this)")
    parser.add_argument("--warm-up-batches", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--postings-in-event-row", action="store_true",
                        help="this checkout's side puts postings in their event's row (migration 0031)")
    parser.add_argument("--base-postings-in-event-row", action="store_true", help="and so does the base's side")
    parser.add_argument("--durable", action="store_true", help="each batch as the durable writer runs it, and waited for its flush")
    parser.add_argument("--holds", action="store_true", help="each batch one call of the hold placement, as the holds' writer makes it")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the root of one side's checkout
    args = parser.parse_args()
    if args.batches < 2:
        raise SystemExit("--batches must be at least 2")
    if args.worker:
        worker(args.worker, args.database_url, args.batches, args.batch_size, args.warm_up_batches, args.postings_in_event_row,
               args.durable, args.holds)
        return
    sys.path.insert(0, str(REPO / "benchmarks"))
    from scratch import print_result

    print_result(compare(args.base, args.database_url, args.batches, args.batch_size, args.warm_up_batches,
                         args.postings_in_event_row, args.base_postings_in_event_row, args.durable, args.holds), args.json)


if __name__ == "__main__":
    main()
