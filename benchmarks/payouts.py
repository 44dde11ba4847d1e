"""Payouts per second: requests through the ledger, and whole payouts (requested,
sent, settled) through the payouts table and the ledger.

On a scratch database, OWNERS owners with earnings and a destination each.
One process asks for one payout per owner, one after another: the payout's row
and its `PayoutRequested` event in one transaction (`request_payout`); then
takes each to sent and settled (`record_sent`, `settle`, one transaction).
The baseline, run before and after in the same process, is the ledger's own
cheapest durable write: one operator adjustment per transaction (`append_now`).
The ratios are what to read: this machine is shared and absolute numbers drift.
With --threads N the requests are also made by N threads at once (one payout
per owner each: the in-flight rule refuses none of them).

    python benchmarks/payouts.py --json
    python benchmarks/payouts.py --database-url sqlite:///tmp/bench.db --json

The database in the URL is only used to create (and finally drop) a scratch
database of the benchmark's own.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scratch import ScratchDatabase, log  # noqa: E402

from app.payments import payouts as po  # noqa: E402
from app.payments.payout_checks import payout_problems  # noqa: E402
from ledger import commands as cmd  # noqa: E402
from ledger.accounts import create_account  # noqa: E402
from ledger.db import normalise_url  # noqa: E402
from ledger.service import append_now  # noqa: E402
from ledger.verify import verify  # noqa: E402

USD = 10**9
EARNINGS_NANO_USD = 1_000 * USD
PAYOUT_NANO_USD = 25 * USD
RULES = po.PayoutRules(min_nano_usd=10 * USD, fee_nano_usd={po.USDC: USD // 10, po.STRIPE: 0})


def per_second(count: int, work) -> float:
    started = time.perf_counter()
    work()
    return count / (time.perf_counter() - started)


def make_owners(engine, count: int) -> list[int]:
    owners = []
    with engine.begin() as conn:
        for i in range(count):
            owner = create_account(conn, cmd.OWNER, f"owner {i}")
            po.set_destination(conn, owner, po.USDC, f"0x{i + 1:040x}")
            owners.append(owner)
    for owner in owners:
        append_now(engine, cmd.AdjustBalance(owner, EARNINGS_NANO_USD, "earnings", f"earn:{owner}"))
    return owners


def adjustments_per_s(engine, owners: list[int], tag: str) -> float:
    def work():
        for owner in owners:
            append_now(engine, cmd.AdjustBalance(owner, 1, "baseline", f"baseline:{tag}:{owner}"))
    return per_second(len(owners), work)


def requests_per_s(engine, owners: list[int], threads: int) -> tuple[float, list[int]]:
    ids: list[int] = []

    def one(owner: int) -> None:
        ids.append(po.request_payout(engine, owner, po.USDC, PAYOUT_NANO_USD, RULES)["id"])

    def work():
        if threads == 1:
            for owner in owners:
                one(owner)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, owners))
    return per_second(len(owners), work), ids


def settlements_per_s(engine, payout_ids: list[int]) -> float:
    def work():
        for payout_id in payout_ids:
            with engine.begin() as conn:
                po.record_sent(conn, payout_id, f"0x{payout_id:064x}", {"nonce": payout_id})
                po.settle(conn, payout_id, f"0x{payout_id:064x}")
    return per_second(len(payout_ids), work)


def run(scratch: ScratchDatabase, owners_count: int, threads: int) -> dict:
    engine = scratch.engine()
    try:
        owners = make_owners(engine, owners_count)
        before = adjustments_per_s(engine, owners, "before")
        requested, ids = requests_per_s(engine, owners, 1)
        settled = settlements_per_s(engine, ids)
        threaded, threaded_ids = requests_per_s(engine, owners, threads) if threads > 1 else (None, [])
        after = adjustments_per_s(engine, owners, "after")
        with engine.connect() as conn:
            ok = verify(conn).ok and not payout_problems(conn)
    finally:
        engine.dispose()
    baseline = (before + after) / 2
    result = {
        "owners": owners_count, "adjustments_per_s_before": round(before, 1), "adjustments_per_s_after": round(after, 1),
        "payout_requests_per_s": round(requested, 1), "payout_requests_ratio": round(requested / baseline, 3),
        "payouts_sent_and_settled_per_s": round(settled, 1), "payouts_sent_and_settled_ratio": round(settled / baseline, 3),
        "verify_ok": ok, "load_average_1m": os.getloadavg()[0],
    }
    if threaded is not None:
        result.update({"threads": threads, "payout_requests_per_s_threaded": round(threaded, 1),
                       "payout_requests_threaded_ratio": round(threaded / baseline, 3), "threaded_requests": len(threaded_ids)})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--owners", type=int, default=500, help="owners, each asking for one payout per round")
    parser.add_argument("--threads", type=int, default=4, help="threads asking at once in the threaded round (1: none)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    log(f"payouts: {args.owners} owners ...")
    with ScratchDatabase(args.database_url, "paralon_bench_payouts") as scratch:
        result = run(scratch, args.owners, args.threads)
    result["database"] = normalise_url(args.database_url).get_backend_name()
    log(f"  {result['payout_requests_per_s']:.0f} requests/s ({result['payout_requests_ratio']:.2f}x the baseline), "
        f"{result['payouts_sent_and_settled_per_s']:.0f} sent and settled/s")
    print(json.dumps(result, sort_keys=True) if args.json else json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
