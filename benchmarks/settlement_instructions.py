"""The Python a settlement costs outside the database, in instructions: this checkout, or against another revision.

Two parts, each without a database: the caller's checks (a hold's and its
settlement's command built and validated, as `place_hold_async` and
`append_async` do before queueing) and the writer's own Python for a batch
(digests, rules, drafts, COPY text, refusals, the hash chain). Each runs
under valgrind's callgrind, which counts instructions rather than time: the
same code gives the same count whatever else the machine is doing, so a cut
of a few per cent shows where whole runs drift by a third. Each part runs
at two batch sizes and the difference, less the set-up's, is divided by the
settlements between them, so start-up and imports cancel out.

    python benchmarks/settlement_instructions.py --base HEAD~1 --json

Prints one JSON line: instructions per settlement of each part, and with
--base, the base's and the ratio (below 1 is fewer). Needs valgrind.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from checkout import REPO, revision_checkout

PARTS = ("caller", "writer")
SMALL, LARGE = 1000, 3000  # settlements per run: the difference is what is counted
CUSTOMERS = 64


def run_part(part: str, count: int) -> None:
    """One part over `count` settlements, imported from whichever checkout is first on sys.path."""
    from ledger import commands as cmd
    from ledger import events as ev
    from ledger import store
    from ledger.hold_commands import validate_place_hold
    from ledger.holds import PlaceHold
    from ledger.storage.postgres import PostgresStorage

    def settlement(h: int) -> cmd.SettleRequest:
        return cmd.SettleRequest(h, 2, 150 * (900 + h % 97), f"req:0.{h}:{h}", f"s:0.{h}:{h}",
                                 {"model": "bench", "prompt_tokens": 900 + h % 97})

    book = store._BatchBook()
    book.system = {cmd.PLATFORM_REVENUE_ACCOUNT: 1}
    book.kinds = {1: "platform", 2: cmd.OWNER}
    for h in range(count):
        book.holds[h] = cmd.HoldView(h, 100 + h % CUSTOMERS, 5_000_000, True)
        book.kinds[100 + h % CUSTOMERS] = cmd.CUSTOMER
    book.balances = {account: 10**15 for account in book.kinds}
    commands = [settlement(h) for h in range(count)]
    if part == "caller":
        for h in range(count):
            validate_place_hold(PlaceHold(100 + h % CUSTOMERS, 5_000_000, f"h:0.{h}:{h}"))
            cmd.validate_shape(settlement(h))
    elif part == "writer":
        if hasattr(store, "_texts_and_digests"):  # settlements' texts written directly (since dd6c9c4)
            texts, digests = store._texts_and_digests(commands)
            prepared, _ = store._prepare(commands, digests, texts, list(range(count)), book, [None] * count)
        else:
            digests = [cmd.command_digest(c) for c in commands]
            prepared, _ = store._prepare(commands, digests, list(range(count)), book, [None] * count)
        drafts = list(prepared.values())
        PostgresStorage().encode_unchained([d.columns for d in drafts], [d.postings for d in drafts])
        prev_hex = ev.GENESIS_HASH.hex()
        for seq, draft in enumerate(drafts, 1):
            if store._refusal(book, draft.event, draft.postings) is None:
                prev_hex = ev.chained_hash(prev_hex, seq, "2026-12-02T11:00:00.000000Z", draft.hashed).hex()


def instructions(root: str, part: str, count: int) -> int:
    """Instructions callgrind counts for one run of a part (hash seed fixed: dict layouts repeat)."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
         "--child", part, str(count), root],
        env=dict(os.environ, PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1"), capture_output=True, text=True,
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or not found:
        raise SystemExit(f"callgrind failed on {part} at {count}:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_settlement(root: str) -> dict[str, int]:
    runs = [(part, count) for part in ("setup", *PARTS) for count in (SMALL, LARGE)]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two cores: callgrind runs one thread each
        counted = dict(zip(runs, pool.map(lambda run: instructions(root, *run), runs)))
    setup = counted["setup", LARGE] - counted["setup", SMALL]
    return {part: round((counted[part, LARGE] - counted[part, SMALL] - setup) / (LARGE - SMALL)) for part in PARTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base", help="a revision to count too (a temporary git worktree)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--child", nargs=3, metavar=("PART", "COUNT", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        part, count, root = args.child
        sys.path.insert(0, root)
        run_part(part, int(count))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: valgrind)")
    result = {f"{part}_instructions_per_settlement": n for part, n in per_settlement(str(REPO)).items()}
    if args.base:
        with revision_checkout(args.base) as base_root:
            base = per_settlement(base_root)
        result["base"] = args.base
        for part, n in base.items():
            result[f"base_{part}_instructions_per_settlement"] = n
            result[f"{part}_ratio_to_base"] = round(result[f"{part}_instructions_per_settlement"] / n, 4)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
