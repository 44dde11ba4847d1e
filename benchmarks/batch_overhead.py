"""What a batch costs whatever its size: CPU per settlement at several batch sizes, and the fixed part.

Holds placed, then settled, batch after batch through the ledger's
group-commit writers (postings in their events' rows), at each batch size in
turn, the order alternating between repetitions so that drift hits every
size alike. For each size: this process's CPU (the callers, both writers'
Python and their driver) and every local PostgreSQL process's, per
settlement. A least-squares line through CPU per round (one batch of holds
and one of settlements) against its size splits each into a part per batch
(round trips, planning, each statement's start) and a part per settlement:
how much fewer statements and round trips could save, against how much
fewer bytes and less work per row could.

    python benchmarks/batch_overhead.py --json
    python benchmarks/batch_overhead.py --sizes 16,64,256,1024 --json

Prints one JSON line: by_size (client and PostgreSQL µs a settlement),
fixed_us_per_round and per_settlement_us (client, PostgreSQL), and the fixed
part's share at the largest size. The throughput run's batches are about 512.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger.service import Ledger  # noqa: E402
from ledger.store import set_postings_in_event_row  # noqa: E402
from scratch import ScratchDatabase, funded_accounts, hold_then_settle, log, postgres_cpu_s, print_result, short_keys  # noqa: E402

CUSTOMERS, OWNERS = 64, 8
WARM_UP_ROUNDS = 4


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares y = fixed + slope * x."""
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def measure(ledger: Ledger, customers: list[int], owners: list[int], sizes: list[int], settlements_per_size: int,
            repetitions: int) -> dict[int, tuple[float, float]]:
    """CPU seconds (this process, PostgreSQL) each size used in all."""
    used = {size: [0.0, 0.0] for size in sizes}
    for repetition in range(repetitions):
        for size in sizes if repetition % 2 == 0 else sizes[::-1]:
            log(f"repetition {repetition + 1}/{repetitions}: batches of {size} ...")
            client_started, server_started = time.process_time(), postgres_cpu_s()
            for r in range(settlements_per_size // size):
                hold_then_settle(ledger, customers, owners, short_keys(f"{repetition}:{size}:{r}", size))
            used[size][0] += time.process_time() - client_started
            used[size][1] += postgres_cpu_s() - server_started
    return {size: (client, server) for size, (client, server) in used.items()}


def summarise(used: dict[int, tuple[float, float]], settlements_per_size: int, repetitions: int) -> dict:
    settled = settlements_per_size * repetitions
    rounds = {size: settled // size for size in used}
    largest = max(used)
    result: dict = {"by_size": {size: {"client_us_per_settlement": round(client / settled * 1e6, 1),
                                       "postgres_us_per_settlement": round(server / settled * 1e6, 1)}
                                for size, (client, server) in sorted(used.items())}}
    for side, index in (("client", 0), ("postgres", 1)):
        fixed_s, per_settlement_s = _line([(size, cpu[index] / rounds[size]) for size, cpu in used.items()])
        total_at_largest = used[largest][index] / settled
        result[f"{side}_fixed_us_per_round"] = round(fixed_s * 1e6)
        result[f"{side}_per_settlement_us"] = round(per_settlement_s * 1e6, 1)
        result[f"{side}_fixed_share_at_{largest}"] = round(fixed_s / largest / total_at_largest, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--sizes", default="32,128,512", help="batch sizes, comma-separated")
    parser.add_argument("--settlements", type=int, default=8192, help="per size and repetition (a multiple of each size)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    try:
        sizes = sorted({int(size) for size in args.sizes.split(",")})
    except ValueError:
        raise SystemExit(f"--sizes takes whole numbers separated by commas, not {args.sizes!r}") from None
    if len(sizes) < 2 or sizes[0] < 1 or any(args.settlements % size for size in sizes) or args.repetitions < 1:
        raise SystemExit("give two sizes or more, each at least 1 and dividing --settlements, and one repetition or more")
    if postgres_cpu_s() is None:
        raise SystemExit("PostgreSQL's CPU is read from this machine's /proc: run the benchmark beside the server")
    with ScratchDatabase(args.database_url, "paralon_batchcost") as scratch:
        engine = scratch.engine()
        with engine.begin() as conn:
            set_postings_in_event_row(conn, True)
        ledger = Ledger(engine, batch_size_max=sizes[-1])
        try:
            customers, owners = funded_accounts(ledger, CUSTOMERS, OWNERS)
            for r in range(WARM_UP_ROUNDS):
                hold_then_settle(ledger, customers, owners, short_keys(f"warm{r}", sizes[-1]))
            with engine.connect() as conn:
                conn.execute(text("ANALYZE"))
                conn.commit()
            used = measure(ledger, customers, owners, sizes, args.settlements, args.repetitions)
        finally:
            ledger.close()
            engine.dispose()
    print_result({**summarise(used, args.settlements, args.repetitions), "sizes": sizes,
                  "settlements_per_size": args.settlements * args.repetitions}, args.json)


if __name__ == "__main__":
    main()
