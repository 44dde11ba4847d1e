"""What `paralon ledger verify` proves of payouts on their rails, when a rail
is configured: the references the ledger holds exist there and say what the
ledger says.

- USDC: a settled payout's transaction is mined (status 1) with a Transfer of
  exactly its raw amount from the hot wallet to its destination; a payout in
  flight has a signed transaction the node knows (pending or mined), unless
  none was broadcast yet.
- Stripe: a settled payout's transfer exists for its cents and destination
  and is not reversed; a payout in flight has no transfer yet or exactly one.
Settled payouts are checked newest first, at most PAYOUT_REFERENCES_CHECKED_MAX."""
from __future__ import annotations

from sqlalchemy import Connection, select
from web3 import Web3
from web3.exceptions import TransactionNotFound

from app.limits import EVM_RECEIPT_STATUS_SUCCESS, PAYOUT_REFERENCES_CHECKED_MAX, STRIPE_TRANSFERS_LISTED_MAX
from app.payments import payouts as po
from app.payments.crypto import TRANSFER_EVENT
from app.payments.schema import payout_transactions, payouts
from ledger.money import NANO_USD_PER_CENT


def _to_check(conn: Connection, rail: str) -> list[dict]:
    p = payouts.c
    rows = conn.execute(select(payouts).where(p.rail == rail, p.state.in_((*po.IN_FLIGHT, po.SETTLED)))
                        .order_by(p.id.desc()).limit(PAYOUT_REFERENCES_CHECKED_MAX))
    return [dict(row._mapping) for row in rows]


def chain_problems(conn: Connection, w3: Web3, wallet: str, token: str) -> tuple[int, list[str]]:
    """(payouts checked, problems) of the USDC rail against the node."""
    rows, problems = _to_check(conn, po.USDC), []
    for row in rows:
        if row["state"] == po.SETTLED:
            problems += _settled_transfer_problems(w3, row, wallet, token)
            continue
        hashes = conn.execute(select(payout_transactions.c.tx_hash, payout_transactions.c.broadcast_at)
                              .where(payout_transactions.c.payout_id == row["id"])).all()
        if any(broadcast for _, broadcast in hashes) and not any(_known(w3, tx_hash) for tx_hash, _ in hashes):
            problems.append(f"payout {row['id']} ({row['state']}): none of its {len(hashes)} broadcast transaction(s) is known to "
                            "the node (`paralon payouts send` broadcasts the stored one again)")
    return len(rows), problems


def _known(w3: Web3, tx_hash: str) -> bool:
    try:
        return w3.eth.get_transaction(tx_hash) is not None
    except TransactionNotFound:
        return False


def _settled_transfer_problems(w3: Web3, row: dict, wallet: str, token: str) -> list[str]:
    what = f"payout {row['id']} (settled by {row['reference']})"
    try:
        receipt = w3.eth.get_transaction_receipt(row["reference"])
    except TransactionNotFound:
        return [f"{what}: the chain has no such mined transaction"]
    if receipt["status"] != EVM_RECEIPT_STATUS_SUCCESS:
        return [f"{what}: the transaction reverted"]
    wanted = (Web3.to_checksum_address(wallet), Web3.to_checksum_address(row["destination"]), int(row["raw_amount"]))
    for entry in receipt["logs"]:
        if Web3.to_checksum_address(entry["address"]) != Web3.to_checksum_address(token):
            continue
        args = TRANSFER_EVENT.process_log(entry)["args"]
        if (args["from"], args["to"], args["value"]) == wanted:
            return []
    return [f"{what}: no Transfer of {wanted[2]} from the hot wallet to {row['destination']} in it"]


def stripe_problems(conn: Connection, transfers_of_group, key_of) -> tuple[int, list[str]]:
    """(payouts checked, problems) of the Stripe rail; `transfers_of_group(key)` lists Stripe's
    transfers of a payout's group (its idempotency key), `key_of(payout_id)` names it."""
    rows, problems = _to_check(conn, po.STRIPE), []
    for row in rows:
        found = transfers_of_group(key_of(row["id"]))
        if row["state"] != po.SETTLED:
            if len(found) > 1:
                problems.append(f"payout {row['id']} ({row['state']}): {len(found)} transfers on Stripe")
            continue
        cents = (row["amount_nano_usd"] - row["fee_nano_usd"]) // NANO_USD_PER_CENT
        matching = [t for t in found if t["id"] == row["reference"]]
        if len(found) != 1 or not matching:
            problems.append(f"payout {row['id']} (settled by {row['reference']}): Stripe has {len(found)} transfer(s) for it")
        elif (matching[0]["amount"], matching[0]["destination"], matching[0].get("reversed")) != (cents, row["destination"], False):
            t = matching[0]
            problems.append(f"payout {row['id']}: Stripe's transfer {t['id']} is {t['amount']} cents to {t['destination']}"
                            f"{' (reversed)' if t.get('reversed') else ''}, the ledger's {cents} to {row['destination']}")
    return len(rows), problems


def rail_problems(conn: Connection, chain, stripe_settings) -> tuple[list[str], list[str]]:
    """(notes, problems) of every configured rail: `chain` is a PayoutChainSettings, `stripe_settings` a StripeSettings."""
    from app.payments import payout_chain, payout_stripe  # only when verifying: web3 and Stripe are slow to load
    from app.payments.stripe_client import client
    from invoices.files import deployment_id

    notes, problems = [], []
    if not chain.missing():
        w3 = payout_chain.connect(chain)
        checked, found = chain_problems(conn, w3, payout_chain.wallet_address(chain.wallet_key), chain.token.address)
        notes.append(f"USDC payouts checked on chain {w3.eth.chain_id}: {checked}")
        problems += found
    if stripe_settings.secret_key:
        sdk, deployment = client(stripe_settings, "checking payouts"), deployment_id(conn)

        def transfers_of_group(key: str) -> list[dict]:
            listed = sdk.v1.transfers.list(params={"transfer_group": key, "limit": STRIPE_TRANSFERS_LISTED_MAX})
            return [t.to_dict() for t in listed.data]
        checked, found = stripe_problems(conn, transfers_of_group, lambda payout_id: payout_stripe.transfer_key(deployment, payout_id))
        notes.append(f"Stripe payouts checked on Stripe: {checked}")
        problems += found
    return notes, problems
