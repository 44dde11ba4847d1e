"""The server's time of each statement a settlement runs, per settlement, from pg_stat_statements.

Settlements go through the ledger as the service sends them: holds placed
by the hold writer, then settled by the durable writer, batch after batch
(so the hold tables see the churn they see in service), postings in their
events' rows. Nested statements are counted too (the hold function's, the
triggers'), so a statement's time includes those it runs and the figures do
not add up to a total: read each line, and compare a line before and after a
change, run alternately. A whole throughput run drifts by more than most
single changes move; a statement's own time does not drift as much. Planning
is shown apart where the server tracks it (`track_planning`): the writers
prepare nothing, so a statement sent by the client is planned at every call.

The server must load pg_stat_statements (it is in PostgreSQL's contrib), for
example a private one on this machine:

    initdb -D /tmp/pgstat -A trust -U postgres
    pg_ctl -D /tmp/pgstat -o "-p 5499 -k /tmp -c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all \
        -c pg_stat_statements.track_planning=on" start
    python benchmarks/statement_costs.py --database-url postgresql://postgres@127.0.0.1:5499/postgres --json

The database in the URL is only used to create (and finally drop) a scratch
database of the benchmark's own, where the extension is created.
"""
from __future__ import annotations

import sys
from pathlib import Path

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger.service import Ledger  # noqa: E402
from ledger.store import set_postings_in_event_row  # noqa: E402
from scratch import ScratchDatabase, batch_arguments, funded_accounts, hold_then_settle, log, print_result, short_keys  # noqa: E402

CUSTOMERS, OWNERS = 64, 8
STATEMENTS_SHOWN = 16
QUERY_CHARS_SHOWN = 120
US_PER_MS = 1000

_TOP_STATEMENTS = text("""
SELECT calls, total_exec_time, total_plan_time, left(regexp_replace(query, '\\s+', ' ', 'g'), :chars) AS query
  FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
 ORDER BY total_exec_time + total_plan_time DESC LIMIT :shown
""")


def _require_statistics(engine) -> None:
    with engine.connect() as conn:
        loaded = conn.execute(text("SHOW shared_preload_libraries")).scalar_one()
        if "pg_stat_statements" not in loaded:
            raise SystemExit("the server does not load pg_stat_statements: start one as this module's docstring shows")
        conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        conn.commit()


def main() -> None:
    args = batch_arguments(__doc__.split("\n", 1)[0], batches=40)
    with ScratchDatabase(args.database_url, "paralon_statements") as scratch:
        engine = scratch.engine()
        _require_statistics(engine)
        with engine.begin() as conn:
            set_postings_in_event_row(conn, True)
        ledger = Ledger(engine, batch_size_max=args.batch_size)
        try:
            customers, owners = funded_accounts(ledger, CUSTOMERS, OWNERS)
            for r in range(args.warm_up_batches):
                hold_then_settle(ledger, customers, owners, short_keys(f"warm{r}", args.batch_size))
            with engine.connect() as conn:
                conn.execute(text("ANALYZE"))
                conn.execute(text("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = current_database()), 0)"))
                conn.commit()
            log(f"{args.batches} batches of {args.batch_size} ...")
            for r in range(args.batches):
                hold_then_settle(ledger, customers, owners, short_keys(f"m{r}", args.batch_size))
            settled = args.batches * args.batch_size
            with engine.connect() as conn:
                rows = conn.execute(_TOP_STATEMENTS, {"chars": QUERY_CHARS_SHOWN, "shown": STATEMENTS_SHOWN}).all()
        finally:
            ledger.close()
            engine.dispose()
    print_result({
        "settlements": settled,
        "batch_size": args.batch_size,
        "statements": [{"us_per_settlement": round(row.total_exec_time * US_PER_MS / settled, 2),
                        "plan_us_per_settlement": round(row.total_plan_time * US_PER_MS / settled, 2), "calls": row.calls,
                        "query": row.query} for row in rows],
    }, args.json)


if __name__ == "__main__":
    main()
