"""What the order of request ids costs PostgreSQL, in one run: random (UUIDv4,
as the proxy made them before) against ordered by time (`new_request_id`).

A request's id ends its hold's key and its settlement's key, and each key goes
into a unique index (of `holds`, of `ledger_events`). One scratch database per
kind of id. Round after round, alternately first, each places a batch of holds
and settles them through its own ledger's group-commit writers, under the
proxy's keys (`hold_key`, `settlement_key`) for ids of its kind. The CPU its
backends used after a warm-up (from /proc, whose clock ticks every 10 ms:
summed over the rounds, not read one round at a time) is divided by the
settlements, and the ratio given (ordered over random). The indexes grow
as a running ledger's do: each hold is deleted as it settles, and each
settlement's key stays. Ids are made before each round's holds are placed,
so that only where their keys go differs, not how the threads interleave.

    python benchmarks/request_id_order.py --json

Its rounds are `--batches` (100 by default) of `--batch-size` (512).

The database in the URL is only used to create (and finally drop) two
scratch databases of the benchmark's own.
"""
from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger.hold_commands import settlement_key  # noqa: E402
from ledger.service import Ledger  # noqa: E402
from proxy.request_ids import new_request_id  # noqa: E402
from proxy.settlement import hold_key  # noqa: E402
from scratch import (  # noqa: E402
    ScratchDatabase,
    batch_arguments,
    funded_accounts,
    hold_then_settle,
    log,
    postgres_cpu_s_by_pid,
    print_result,
    random_request_id,
)

CUSTOMERS, OWNERS = 64, 8
KINDS = {"random": random_request_id, "ordered": new_request_id}


class Side:
    """One kind of id on its own scratch database and ledger."""

    def __init__(self, scratch: ScratchDatabase, new_id) -> None:
        self.engine = scratch.engine()
        self.ledger = Ledger(self.engine)
        self.customers, self.owners = funded_accounts(self.ledger, CUSTOMERS, OWNERS)
        self.new_id = new_id

    def backend_pids(self) -> set[int]:
        """The ledger's connections' backends (its writers' and its pool's)."""
        with self.engine.connect() as conn:
            return set(conn.exec_driver_sql("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()").scalars())

    def round_cpu_s(self, size: int) -> float:
        pids = self.backend_pids()
        started = postgres_cpu_s_by_pid() or {}
        ids = [self.new_id("chatcmpl-") for _ in range(size)]
        hold_then_settle(self.ledger, self.customers, self.owners, [(hold_key(rid), rid, settlement_key(rid)) for rid in ids])
        ended = postgres_cpu_s_by_pid() or {}
        return sum(ended[pid] - started[pid] for pid in pids & started.keys() & ended.keys())

    def close(self) -> None:
        self.ledger.close()
        self.engine.dispose()


def main() -> None:
    args = batch_arguments(__doc__.split("\n\n")[0], batches=100, batch_size=512)
    if args.batches < 1 or args.batch_size < 1 or args.warm_up_batches < 0:
        raise SystemExit("--batches and --batch-size must be at least 1, --warm-up-batches at least 0")
    if postgres_cpu_s_by_pid() is None:
        raise SystemExit("the backends' CPU is read from /proc: run on the database server's machine (Linux)")
    with ExitStack() as stack:
        sides = {}
        for kind, new_id in KINDS.items():
            sides[kind] = Side(stack.enter_context(ScratchDatabase(args.database_url, f"paralon_ids_{kind}")), new_id)
            stack.callback(sides[kind].close)
        log(f"{args.batches} rounds of {args.batch_size} settlements on each kind of id ...")
        used_s = dict.fromkeys(KINDS, 0.0)
        order = list(KINDS)
        for round_ in range(args.warm_up_batches + args.batches):
            for kind in (order if round_ % 2 == 0 else order[::-1]):
                cpu_s = sides[kind].round_cpu_s(args.batch_size)
                if round_ >= args.warm_up_batches:
                    used_s[kind] += cpu_s
    per_settlement = {kind: round(s / (args.batches * args.batch_size) * 1e6, 2) for kind, s in used_s.items()}
    print_result({"postgres_cpu_us_per_settlement": per_settlement,
                  "ordered_to_random": round(used_s["ordered"] / used_s["random"], 3) if used_s["random"] else None,
                  "rounds": args.batches, "batch_size": args.batch_size}, args.json)


if __name__ == "__main__":
    main()
