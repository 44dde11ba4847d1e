"""Payouts per second: requests through the ledger, whole payouts (requested,
sent, settled) through the payouts table and the ledger, and USDC payouts
signed and broadcast on a real EVM node (anvil).

On a scratch database, OWNERS owners with earnings and a destination each.
One process asks for one payout per owner, one after another: the payout's row
and its `PayoutRequested` event in one transaction (`request_payout`); then
takes each to sent and settled (`record_sent`, `settle`, one transaction).
The baseline, run before and after in the same process, is the ledger's own
cheapest durable write: one operator adjustment per transaction (`append_now`).
The ratios are what to read: this machine is shared and absolute numbers drift.
With --threads N the requests are also made by N threads at once (one payout
per owner each: the in-flight rule refuses none of them).

On chain (skipped with --no-chain): anvil with the project's 6-decimal test
token and a funded hot wallet; CHAIN_PAYOUTS owners each ask for a payout, and
`paralon payouts send`'s function (`send_once`, at most PAYOUTS_SIGNED_PER_RUN_MAX
a run) signs, stores and broadcasts them all, then settles them after the
confirmations. The baseline, in the same run on the same node, is the bare
cost of the same transfers: web3.py signing and broadcasting one ERC-20
transfer after another from a second funded wallet, nothing stored.

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


def run_chain(scratch: ScratchDatabase, count: int) -> dict:
    from eth_account import Account

    from app.payments.chain_settings import PayoutChainSettings, Token
    from app.payments.payout_chain import send_once, transfer_data
    from tests.support.anvil import deploy_stablecoin, mine, running_anvil

    engine = scratch.engine()
    confirmations = 2
    try:
        with running_anvil() as w3:
            token = deploy_stablecoin(w3)
            wallets = [Account.create() for _ in range(2)]
            for wallet in wallets:
                w3.provider.make_request("anvil_setBalance", [wallet.address, hex(10**21)])
                w3.eth.wait_for_transaction_receipt(token.functions.mint(wallet.address, 10**15).transact({"from": w3.eth.accounts[0]}))
            owners = make_owners(engine, count)
            for owner in owners:
                po.request_payout(engine, owner, po.USDC, PAYOUT_NANO_USD, RULES)
            settings = PayoutChainSettings(w3.provider.endpoint_uri, "0x" + bytes(wallets[0].key).hex(),
                                           Token(token.address, 6, "TUSD"), confirmations)
            bare = per_second(count, lambda: _bare_transfers(w3, wallets[1], token.address, count, transfer_data))
            runs, started = [], time.perf_counter()
            signed_s = settled_s = None
            while settled_s is None:  # anvil mines each transfer at once; a run that settles nothing waits for a block
                runs.append(send_once(engine, w3, settings))
                if signed_s is None and sum(r.signed for r in runs) >= count:
                    signed_s = time.perf_counter() - started
                if sum(r.settled for r in runs) >= count:
                    settled_s = time.perf_counter() - started
                elif not runs[-1].signed and not runs[-1].settled:
                    mine(w3, 1)
            sent, settled = count / signed_s, count / settled_s
            transfers = token.events.Transfer().get_logs(from_block=0, argument_filters={"from": wallets[0].address})
        with engine.connect() as conn:
            ok = verify(conn).ok and not payout_problems(conn)
    finally:
        engine.dispose()
    return {"chain_payouts": count, "chain_transfers_on_chain": len(transfers), "bare_transfers_per_s": round(bare, 1),
            "payouts_signed_and_broadcast_per_s": round(sent, 1), "payouts_signed_and_broadcast_ratio": round(sent / bare, 3),
            "sender_runs": len(runs), "payouts_settled_per_s": round(settled, 1), "chain_verify_ok": ok}


def _bare_transfers(w3, wallet, token_address: str, count: int, transfer_data) -> None:
    nonce = w3.eth.get_transaction_count(wallet.address, "pending")
    for i in range(count):
        tx = {"to": token_address, "data": transfer_data(f"0x{i + 1:040x}", 1), "nonce": nonce + i, "gas": 100_000,
              "maxFeePerGas": 2 * 10**9, "maxPriorityFeePerGas": 10**9, "chainId": w3.eth.chain_id, "type": 2}
        w3.eth.send_raw_transaction(wallet.sign_transaction(tx).raw_transaction)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=os.environ.get("PARALON_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--owners", type=int, default=500, help="owners, each asking for one payout per round")
    parser.add_argument("--threads", type=int, default=4, help="threads asking at once in the threaded round (1: none)")
    parser.add_argument("--chain-payouts", type=int, default=200, help="USDC payouts signed and broadcast on anvil")
    parser.add_argument("--no-chain", action="store_true", help="skip the anvil part")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    log(f"payouts: {args.owners} owners ...")
    with ScratchDatabase(args.database_url, "paralon_bench_payouts") as scratch:
        result = run(scratch, args.owners, args.threads)
    if not args.no_chain:
        log(f"on chain: {args.chain_payouts} USDC payouts on anvil ...")
        with ScratchDatabase(args.database_url, "paralon_bench_payouts_chain") as scratch:
            result.update(run_chain(scratch, args.chain_payouts))
        log(f"  {result['payouts_signed_and_broadcast_per_s']:.0f} signed and broadcast/s "
            f"({result['payouts_signed_and_broadcast_ratio']:.2f}x bare web3 transfers), {result['payouts_settled_per_s']:.0f} settled/s")
    result["database"] = normalise_url(args.database_url).get_backend_name()
    log(f"  {result['payout_requests_per_s']:.0f} requests/s ({result['payout_requests_ratio']:.2f}x the baseline), "
        f"{result['payouts_sent_and_settled_per_s']:.0f} sent and settled/s")
    print(json.dumps(result, sort_keys=True) if args.json else json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
