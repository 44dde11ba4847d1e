"""What placing and renewing a hold costs the server, as migrated and as before
a migration, in one run: 0037 (the default: the hold function placed every
batch in some ten statements), 0036 (it looked every key up before its
insert) or 0032 (an index by expiry, full pages).

Two scratch databases, one put back as it was before that migration. Round after round,
alternately first, each places a batch of holds through the hold function
(64 customers), renews every one of them as running requests do (expiry and
capture), and closes them as settlements do. The server's own time and WAL for
the placement and the renewal come from EXPLAIN (ANALYZE, WAL); medians per
hold after a warm-up, and their ratios (as migrated over before).

    python benchmarks/holds_writes.py --database-url postgresql://postgres@127.0.0.1:5432/postgres --before 0036 --json
    python benchmarks/holds_writes.py --before 0037 --holds 1 --rounds 400 --json

The second places one hold a call, as the holds' writer does at a few
requests a millisecond: what a call costs before its holds.

The database in the URL is only used to create (and finally drop) two scratch
databases of the benchmark's own.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.migrate import earlier_revision  # noqa: E402
from ledger import commands as cmd  # noqa: E402
from ledger.schema import utc_now  # noqa: E402
from ledger.service import Ledger  # noqa: E402
from ledger.storage.pg_arrays import ints, nullable_ints, nullable_texts, texts  # noqa: E402
from ledger.storage.postgres import _CLOSE_HOLDS, _PLACE_HOLDS, _RENEW_HOLDS  # noqa: E402
from scratch import ScratchDatabase, log, print_result  # noqa: E402

CUSTOMERS = 64
HOLD_NANO_USD = 1_000_000
HOLD_TTL_S = 30
CAPTURE_NANO_USD = 5_000
US_PER_MS = 1000
LAYOUTS = ("as_migrated", "before")


def statements_before(revision: str) -> list[str]:
    """What puts a migrated database back as it was before `revision`, in what this benchmark measures."""
    if revision == "0032":
        return ["CREATE INDEX ix_holds_expiry ON holds (expires_at)", "ALTER TABLE holds RESET (fillfactor)"]
    revision_0036 = earlier_revision("0036_holds_placed_without_looking_their_keys_up.py")
    # The revision's downgrade, and the search path each migration leaves (app.db_roles.harden_functions)
    function = (earlier_revision("0037_holds_placed_for_customers_in_fewer_statements.py").function_of_0036()
                if revision == "0037" else revision_0036.function_of_0028())
    return [*function, f"ALTER FUNCTION {revision_0036.SIGNATURE} SET search_path = pg_catalog, public, pg_temp"]


def prepared(scratch: ScratchDatabase, put_back: list[str]):
    """The scratch database's raw connection (autocommit) and its customers, each with credits."""
    engine = scratch.engine()
    ledger = Ledger(engine)
    customers = [ledger.create_account(cmd.CUSTOMER, f"holds customer {i}") for i in range(CUSTOMERS)]
    for customer in customers:
        ledger.append(cmd.GrantCredits(customer, 10**15, "benchmark credits", f"grant:{customer}"))
    ledger.close()
    raw = engine.raw_connection()
    raw.driver_connection.autocommit = True
    for statement in put_back:
        raw.driver_connection.execute(statement)
    return engine, raw, customers


def server_us_and_wal(conn, sql: str, params: dict) -> tuple[float, int]:
    plan = conn.execute("EXPLAIN (ANALYZE, WAL, FORMAT JSON) " + sql, params).fetchone()[0][0]
    return plan["Execution Time"] * US_PER_MS, plan["Plan"].get("WAL Bytes", 0)


def one_round(conn, customers: list[int], round_: int, holds: int) -> dict[str, float]:
    """Per hold: the placement's and the renewal's server µs and WAL bytes."""
    place = {"account": ints([customers[i % CUSTOMERS] for i in range(holds)]), "amount": ints([HOLD_NANO_USD] * holds),
             "minimum": nullable_ints([None] * holds), "key": texts([f"h:{round_}:{i}" for i in range(holds)]),
             "ttl_s": ints([HOLD_TTL_S] * holds), "spend_limit": nullable_ints([None] * holds),
             "replica": nullable_texts([None] * holds), "now": utc_now()}
    place_us, place_wal = server_us_and_wal(conn, _PLACE_HOLDS, place)
    ids = [row[0] for row in conn.execute("SELECT id FROM holds ORDER BY id").fetchall()]
    renew = {"now": utc_now(), "id": ints(ids), "ttl_s": ints([HOLD_TTL_S] * len(ids)), "capture": ints([CAPTURE_NANO_USD] * len(ids)),
             "owner": nullable_ints([None] * len(ids)), "request_id": nullable_texts([None] * len(ids)),
             "meta": nullable_texts([None] * len(ids))}
    renew_us, renew_wal = server_us_and_wal(conn, _RENEW_HOLDS, renew)
    conn.execute(_CLOSE_HOLDS, {"id": ints(ids)})
    return {"place_us": place_us / holds, "place_wal_bytes": place_wal / holds,
            "renew_us": renew_us / len(ids), "renew_wal_bytes": renew_wal / len(ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warm-up-rounds", type=int, default=5)
    parser.add_argument("--holds", type=int, default=400, help="holds per round")
    parser.add_argument("--before", choices=("0037", "0036", "0032"), default="0037", help="the migration whose effect is measured")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    with ExitStack() as stack:
        sides = {}
        for layout in LAYOUTS:
            scratch = stack.enter_context(ScratchDatabase(args.database_url, f"paralon_holds_{layout}"))
            engine, raw, customers = prepared(scratch, statements_before(args.before) if layout == "before" else [])
            stack.callback(engine.dispose)
            stack.callback(raw.close)
            sides[layout] = (raw.driver_connection, customers)
        log(f"{args.rounds} rounds of {args.holds} holds on each layout ...")
        figures: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
        for round_ in range(args.warm_up_rounds + args.rounds):
            for layout in (LAYOUTS if round_ % 2 == 0 else LAYOUTS[::-1]):
                conn, customers = sides[layout]
                measured = one_round(conn, customers, round_, args.holds)
                if round_ >= args.warm_up_rounds:
                    figures[layout].append(measured)
    medians = {layout: {name: round(statistics.median(r[name] for r in rounds), 2) for name in rounds[0]}
               for layout, rounds in figures.items()}
    result = {**medians, "before_revision": args.before, "rounds": args.rounds, "holds_per_round": args.holds,
              **{f"{name}_ratio": round(medians["as_migrated"][name] / medians["before"][name], 3)
                 for name in medians["as_migrated"] if medians["before"][name]}}
    print_result(result, args.json)


if __name__ == "__main__":
    main()
