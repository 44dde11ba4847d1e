"""`paralon ledger verify` and `paralon ledger replay` over a log of a million events.

The log is written by the ledger itself (holds placed, then settled 80/20, with
a grant now and then), so every hash, sum and balance is one the proxy would
write. Both commands then run as an operator runs them, as subprocesses on the
scratch database, and are timed from start to exit, `--repeat` times one
after the other on the one log (three by default). The baseline, in the same
run, is the least any check must do: read every event and posting row once
through psycopg and throw them away; the ratios say what the checks cost on top.

    python benchmarks/verify_replay.py --database-url postgresql://postgres@127.0.0.1:5432/postgres --json
    python benchmarks/verify_replay.py --postings-in-event-row --json   # postings in their events' rows (migration 0031)

The database in the URL is only used to create (and finally drop) a scratch
database of the benchmark's own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger import commands as cmd  # noqa: E402
from ledger.db import normalise_url  # noqa: E402
from ledger.accounts import create_account  # noqa: E402
from ledger.holds import PlaceHold, place_holds  # noqa: E402
from ledger.store import append_batch, set_postings_in_event_row  # noqa: E402
from scratch import ScratchDatabase, log  # noqa: E402

CUSTOMERS = 256
OWNERS = 32
HOLD_NANO_USD = 5_000_000
BATCH = 5000  # holds placed, then settled, per round
VERIFY_BOUND_S = 30  # what each command should take over a million events
GRANT_EVERY_ROUNDS = 10  # a grant to every customer now and then, as top-ups are


def write_log(engine, events: int) -> int:
    """Batches straight through the ledger's own batch functions, each in its
    own transaction: the same rows the group-commit writers write, sooner."""
    with engine.begin() as conn:
        customers = [create_account(conn, cmd.CUSTOMER, f"bench customer {i}") for i in range(CUSTOMERS)]
        owners = [create_account(conn, cmd.OWNER, f"bench owner {i}") for i in range(OWNERS)]
    written, round_ = 0, 0
    started = time.perf_counter()
    while written < events:
        if round_ % GRANT_EVERY_ROUNDS == 0:
            written += _append(engine, [cmd.GrantCredits(c, 10**13, "benchmark credits", f"grant:{round_}:{c}") for c in customers])
        with engine.begin() as conn:
            holds = place_holds(conn, [PlaceHold(customers[i % CUSTOMERS], HOLD_NANO_USD, f"h:{round_}:{i}")
                                       for i in range(min(BATCH, events - written))])
        written += _append(engine, [cmd.SettleRequest(h.hold_id, owners[i % OWNERS], 150 * (900 + i % 97), f"req:{round_}:{i}", f"s:{round_}:{i}",
                                    {"model": "bench"}) for i, h in enumerate(holds)])
        round_ += 1
        if round_ % 50 == 0:
            log(f"  {written:,} events ({written / (time.perf_counter() - started):,.0f}/s)")
    return written


def _append(engine, commands: list[cmd.Command]) -> int:
    with engine.begin() as conn:
        results = append_batch(conn, commands)
    if failed := [r for r in results if isinstance(r, Exception)]:
        raise SystemExit(f"the log could not be written: {failed[0]!r}")
    return len(results)


def read_everything_s(libpq_url: str) -> float:
    """The baseline: every event and posting row read once, nothing checked."""
    started = time.perf_counter()
    with psycopg.connect(libpq_url) as conn, conn.cursor(name="all_events") as events:
        events.itersize = 10_000
        events.execute("SELECT * FROM ledger_events ORDER BY seq")
        for _ in events:
            pass
        with conn.cursor(name="all_postings") as postings:
            postings.itersize = 10_000
            postings.execute("SELECT event_seq, account_id, amount_nano_usd FROM ledger_postings ORDER BY event_seq, leg")
            for _ in postings:
                pass
    return time.perf_counter() - started


def run_command_s(args: list[str], url: str) -> tuple[float, dict]:
    env = dict(os.environ, PARALON_DATABASE_URL=url, PARALON_MIGRATION_DATABASE_URL=url)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "from app.cli import main; main()", *args, "--json"],
                          env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return elapsed, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="times verify and replay each run on the one log")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--postings-in-event-row", action="store_true", help="write postings in their events' rows (migration 0031)")
    args = parser.parse_args()
    if normalise_url(args.database_url).get_backend_name() != "postgresql":
        raise SystemExit("give a postgresql:// URL")
    with ScratchDatabase(args.database_url, "paralon_verify") as scratch:
        url = scratch.url.render_as_string(hide_password=False)
        engine = scratch.engine()
        if args.postings_in_event_row:
            with engine.begin() as conn:
                set_postings_in_event_row(conn, True)
        log(f"writing {args.events:,} events ...")
        written = write_log(engine, args.events)
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE")
        engine.dispose()
        runs = []
        for run in range(args.repeat):
            log(f"run {run + 1}: reading every row (baseline) ...")
            baseline_s = read_everything_s(url.replace("postgresql+psycopg://", "postgresql://"))
            log(f"  {baseline_s:.1f} s; ledger verify ...")
            verify_s, verified = run_command_s(["ledger", "verify"], url)
            log(f"  {verify_s:.1f} s; ledger replay ...")
            replay_s, replayed = run_command_s(["ledger", "replay"], url)
            log(f"  {replay_s:.1f} s")
            if not verified["ok"] or {verified["events_checked"], replayed["events_replayed"]} != {written}:
                raise SystemExit(f"verify or replay disagreed with the log written: {verified} {replayed}")
            runs.append({"verify_s": round(verify_s, 1), "replay_s": round(replay_s, 1), "read_every_row_s": round(baseline_s, 1),
                         "verify_to_read_ratio": round(verify_s / baseline_s, 2), "replay_to_read_ratio": round(replay_s / baseline_s, 2)})
    result = {"events": written, "verify_ok": True, "runs": runs, "bound_s": VERIFY_BOUND_S,
              "postings_in_event_row": args.postings_in_event_row,
              "verify_s_max": max(r["verify_s"] for r in runs), "replay_s_max": max(r["replay_s"] for r in runs)}
    print(json.dumps(result, sort_keys=True) if args.json else "\n".join(f"{k}: {v}" for k, v in sorted(result.items())))


if __name__ == "__main__":
    main()
