"""Where the server's time goes in a batch's write statement, part by part.

Every durable append holds the append lock through one write statement (the
events, their postings, the balances, the chain's head, as data-modifying CTEs)
and its commit, so that statement's server time bounds settlements per second.
This runs settlement batches through the ledger's own `append_batch` with the
write statement under EXPLAIN (ANALYZE, WAL): it is executed as usual, and the
server reports the time and WAL bytes of each insert, update and trigger.
Medians over the measured batches, per settlement; the shares of each part
are the ratios to read (absolute times drift on a shared machine). Before
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
from scratch import ScratchDatabase, batch_arguments, log, modify_table_nodes, print_result  # noqa: E402

CUSTOMERS = 64
OWNERS = 8
HOLD_NANO_USD = 5_000_000
EXPLAIN = "EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) "
US_PER_MS = 1000


def _parts(plan: dict) -> dict[str, tuple[float, int]]:
    """(ms, WAL bytes) of each insert and update of the statement, by what it writes."""
    found = {f"{node['Operation'].lower()} {node['Relation Name']}": (node["Actual Total Time"], node.get("WAL Bytes", 0))
             for node in modify_table_nodes(plan)}
    for trigger in plan.get("Triggers", []):
        found[f"trigger {trigger['Trigger Name']}"] = (trigger["Time"], 0)
    return found


def _batch(engine, customers: list[int], owners: list[int], tag: str, size: int) -> float:
    """Place `size` holds and settle them in one batch; returns the CPU seconds
    this process spent in `append_batch` (deciding, hashing, encoding, and
    its driver's share of the round trips)."""
    with engine.begin() as conn:
        holds = place_holds(conn, [PlaceHold(customers[i % CUSTOMERS], HOLD_NANO_USD, f"h:{tag}:{i}") for i in range(size)])
    settles = [cmd.SettleRequest(h.hold_id, owners[i % OWNERS], 150 * (900 + i % 97), f"req:{tag}:{i}", f"s:{tag}:{i}",
                                 {"model": "bench", "prompt_tokens": 900 + i % 97}) for i, h in enumerate(holds)]
    with engine.begin() as conn:
        started = time.process_time()
        append_batch(conn, settles)
        return time.process_time() - started


def measure(engine, batches: int, batch_size: int, warm_up_batches: int) -> dict:
    plans: list[dict] = []

    @event.listens_for(engine, "after_cursor_execute")
    def keep_plan(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.startswith(EXPLAIN):
            plan = cursor.fetchone()[0]  # psycopg parses json columns; a text one is parsed here
            plans.append((orjson.loads(plan) if isinstance(plan, str) else plan)[0])

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
    try:
        for b in range(batches):
            _batch(engine, customers, owners, f"b{b}", batch_size)
            log(f"batch {b + 1}/{batches}: {plans[-1]['Execution Time']:.1f} ms")
    finally:
        pg_storage._WRITE_APPENDED, pg_storage._WRITE_APPENDED_WITH_LIMITS = originals
        engine.dispose()
    return {**summarise(plans, batch_size),
            "client_cpu_us_per_settlement": round(statistics.median(client_cpu_s) / batch_size * 1e6, 2)}


def summarise(plans: list[dict], batch_size: int) -> dict:
    total_us = statistics.median(p["Execution Time"] for p in plans) * US_PER_MS / batch_size
    names = sorted({name for p in plans for name in _parts(p)})
    by_part = {}
    for name in names:
        ms = statistics.median(_parts(p).get(name, (0.0, 0))[0] for p in plans)
        wal = statistics.median(_parts(p).get(name, (0.0, 0))[1] for p in plans)
        by_part[name] = {"us_per_settlement": round(ms * US_PER_MS / batch_size, 2),
                         "share": round(ms * US_PER_MS / batch_size / total_us, 3),
                         "wal_bytes_per_settlement": round(wal / batch_size, 1)}
    return {"batches": len(plans), "settlements_per_batch": batch_size,
            "statement_us_per_settlement": round(total_us, 2),
            "planning_us_per_settlement": round(statistics.median(p["Planning Time"] for p in plans) * US_PER_MS / batch_size, 2),
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
