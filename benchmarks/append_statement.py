"""Where the server's time goes in a batch's write, part by part.

Every durable append holds the append lock through its write (a COPY of the
events, a COPY of their postings, then one statement for the balances, the
spend limits and the chain's head) and its commit, so the write's server time
bounds settlements per second. This runs settlement batches through the
ledger's own `append_batch`. The statement runs under EXPLAIN (ANALYZE, WAL):
it is executed as usual, and the server reports the time and WAL bytes of each
update and trigger. Each COPY (which EXPLAIN cannot show) is measured by the
server process's own CPU (`/proc/<pid>/schedstat`, so the server must run on
this machine) and the WAL position before and after it; the postings guard
fires inside the postings' COPY. Medians over the measured batches, per
settlement; the shares of each part are the ratios to read (absolute times
drift on a shared machine). Before
those, as many batches without EXPLAIN give `client_cpu_us_per_settlement`:
the CPU this process spends in `append_batch` per settlement, the appender's
own share of the CPU a settlement costs.

    python benchmarks/append_statement.py --database-url postgresql://postgres@127.0.0.1:5432/postgres --json

The database in the URL is only used to create (and finally drop) a scratch
database of the benchmark's own.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import orjson
from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ledger.storage.postgres as pg_storage  # noqa: E402
from ledger import commands as cmd  # noqa: E402
from ledger.accounts import create_account  # noqa: E402
from ledger.holds import PlaceHold, place_holds  # noqa: E402
from ledger.store import append_batch  # noqa: E402
from scratch import ScratchDatabase, batch_arguments, bench_settlement, log, modify_table_nodes, print_result  # noqa: E402

CUSTOMERS = 64
OWNERS = 8
HOLD_NANO_USD = 5_000_000
EXPLAIN = "EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) "
US_PER_MS = 1000


def _parts(batch: dict) -> dict[str, tuple[float, int]]:
    """(ms, WAL bytes) of each part of a batch's write, by what it writes."""
    plan = batch["plan"]
    found = {f"{node['Operation'].lower()} {node['Relation Name']}": (node["Actual Total Time"], node.get("WAL Bytes", 0))
             for node in modify_table_nodes(plan)}
    for trigger in plan.get("Triggers", []):
        found[f"trigger {trigger['Trigger Name']}"] = (trigger["Time"], 0)
    return {**found, **batch["copies"]}


def _server_cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e6  # nanoseconds on the CPU


class CopyMeter:
    """Wraps the storage's COPY: the server process's CPU and the WAL written, per COPY."""

    def __init__(self) -> None:
        self.copies: dict[str, tuple[float, int]] = {}
        self.original = pg_storage._copy

    def __call__(self, cursor, sql: str, text: str) -> None:
        wal_lsn = "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn"
        pid = cursor.connection.info.backend_pid
        wal_before = int(cursor.execute(wal_lsn).fetchone()[0])
        cpu_before = _server_cpu_ms(pid)
        self.original(cursor, sql, text)
        cpu_ms = _server_cpu_ms(pid) - cpu_before
        self.copies[f"copy {sql.split()[1]}"] = (cpu_ms, int(cursor.execute(wal_lsn).fetchone()[0]) - wal_before)


def _batch(engine, customers: list[int], owners: list[int], tag: str, size: int) -> float:
    """Place `size` holds and settle them in one batch; returns the CPU seconds
    this process spent in `append_batch` (deciding, hashing, encoding, and
    its driver's share of the round trips)."""
    with engine.begin() as conn:
        holds = place_holds(conn, [PlaceHold(customers[i % CUSTOMERS], HOLD_NANO_USD, f"h:{tag}:{i}") for i in range(size)])
    settles = [bench_settlement(h.hold_id, owners[i % OWNERS], tag, i) for i, h in enumerate(holds)]
    with engine.begin() as conn:
        started = time.process_time()
        append_batch(conn, settles)
        return time.process_time() - started


def measure(engine, batches: int, batch_size: int, warm_up_batches: int) -> dict:
    plans: list[dict] = []

    meter = CopyMeter()

    @event.listens_for(engine, "after_cursor_execute")
    def keep_plan(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.startswith(EXPLAIN):
            plan = cursor.fetchone()[0]  # psycopg parses json columns; a text one is parsed here
            plans.append({"plan": (orjson.loads(plan) if isinstance(plan, str) else plan)[0], "copies": meter.copies})
            meter.copies = {}

    with engine.begin() as conn:
        customers = [create_account(conn, cmd.CUSTOMER, f"bench customer {i}") for i in range(CUSTOMERS)]
        owners = [create_account(conn, cmd.OWNER, f"bench owner {i}") for i in range(OWNERS)]
    for customer in customers:
        with engine.begin() as conn:
            append_batch(conn, [cmd.GrantCredits(customer, 10**15, "benchmark credits", f"grant:{customer}")])
    for b in range(warm_up_batches):
        _batch(engine, customers, owners, f"warm{b}", batch_size)
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")
        conn.commit()
    client_cpu_s = [_batch(engine, customers, owners, f"cpu{b}", batch_size) for b in range(batches)]
    originals = (pg_storage._WRITE_APPENDED, pg_storage._WRITE_APPENDED_WITH_LIMITS)
    pg_storage._WRITE_APPENDED, pg_storage._WRITE_APPENDED_WITH_LIMITS = (EXPLAIN + sql for sql in originals)
    pg_storage._copy = meter
    try:
        for b in range(batches):
            _batch(engine, customers, owners, f"b{b}", batch_size)
            log(f"batch {b + 1}/{batches}: {_write_ms(plans[-1]):.1f} ms")
    finally:
        pg_storage._WRITE_APPENDED, pg_storage._WRITE_APPENDED_WITH_LIMITS = originals
        pg_storage._copy = meter.original
        engine.dispose()
    return {**summarise(plans, batch_size),
            "client_cpu_us_per_settlement": round(statistics.median(client_cpu_s) / batch_size * 1e6, 2)}


def _write_ms(batch: dict) -> float:
    """The statement's execution and both COPYs' server CPU."""
    return batch["plan"]["Execution Time"] + sum(ms for ms, _ in batch["copies"].values())


def summarise(plans: list[dict], batch_size: int) -> dict:
    total_us = statistics.median(_write_ms(p) for p in plans) * US_PER_MS / batch_size
    names = sorted({name for p in plans for name in _parts(p)})
    by_part = {}
    for name in names:
        ms = statistics.median(_parts(p).get(name, (0.0, 0))[0] for p in plans)
        wal = statistics.median(_parts(p).get(name, (0.0, 0))[1] for p in plans)
        by_part[name] = {"us_per_settlement": round(ms * US_PER_MS / batch_size, 2),
                         "share": round(ms * US_PER_MS / batch_size / total_us, 3),
                         "wal_bytes_per_settlement": round(wal / batch_size, 1)}
    return {"batches": len(plans), "settlements_per_batch": batch_size,
            "write_us_per_settlement": round(total_us, 2),
            "planning_us_per_settlement": round(statistics.median(p["plan"]["Planning Time"] for p in plans) * US_PER_MS / batch_size, 2),
            "by_part": by_part}


def main() -> None:
    args = batch_arguments(__doc__.split("\n\n")[0], batches=20)
    with ScratchDatabase(args.database_url, "paralon_append_statement") as scratch:
        if scratch.sqlite:
            raise SystemExit("the write statement is PostgreSQL's: give a postgresql:// URL")
        result = measure(scratch.engine(), args.batches, args.batch_size, args.warm_up_batches)
    print_result(result, args.json)


if __name__ == "__main__":
    main()
