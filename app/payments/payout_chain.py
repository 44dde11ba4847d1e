"""The USDC rail of owners' payouts: a hot wallet on an EVM chain pays each
payout of rail `usdc` with one ERC-20 transfer, exactly once through crashes,
dropped transactions and reorganisations.

What makes it exactly once:
- A payout gets one nonce for life. It is taken from the wallet's row, under a
  row lock, in the transaction that stores the signed transaction, and that
  transaction commits BEFORE anything is broadcast. A payout with a stored
  transaction is never signed again under another nonce: after a crash its
  stored bytes are broadcast again.
- A transaction not mined within PARALON_PAYOUT_REPLACE_AFTER_S is replaced by
  one of the same nonce at a higher fee (stored first, then broadcast): only
  one of them can ever be mined.
- Settled only when one of its transactions has a successful receipt in a
  canonical block N deep (PARALON_CRYPTO_CONFIRMATIONS); a transfer whose block
  vanished is broadcast again, never paid again. A reverted transfer fails the
  payout back to earnings once it is N deep, when its nonce is spent and no
  other transaction of it can be mined.
- Nothing is signed to a destination that is not the owner's current one or is
  still cooling down, nor when the wallet cannot cover the tokens and the gas:
  the payout waits in `requested` and the run says why.

The rail-neutral steps (record_sent, settle, fail) are app/payments/payouts.py's.
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_account.typed_transactions import TypedTransaction
from hexbytes import HexBytes
from sqlalchemy import Connection, Engine, exists, select, update
from sqlalchemy.exc import IntegrityError
from web3 import Web3
from web3.exceptions import TransactionNotFound, Web3RPCError

from app.limits import (
    CHAIN_RPC_TIMEOUT_S,
    EVM_DYNAMIC_FEE_TX_TYPE,
    EVM_RECEIPT_STATUS_SUCCESS,
    PAYOUT_BASE_FEE_MULTIPLIER,
    PAYOUT_FEE_BUMP_DENOMINATOR,
    PAYOUT_FEE_BUMP_NUMERATOR,
    PAYOUT_GAS_MARGIN_PERCENT,
    PAYOUT_REPLACEMENTS_MAX,
    PAYOUTS_LOOKED_AT_PER_RUN_MAX,
    PAYOUTS_SIGNED_PER_RUN_MAX,
)
from app.payments import payouts as po
from app.payments.chain_settings import PayoutChainSettings
from app.payments.schema import payout_transactions, payout_wallets, payouts
from ledger.errors import InvalidInput, LedgerError
from ledger.money import PERCENT, nano_usd_per_unit
from ledger.schema import utc_now

log = logging.getLogger("paralon.payouts.usdc")

# A test fault point, and nothing else: with PARALON_PAYOUT_FAULT=after_store (or
# after_broadcast) the sender kills itself with SIGKILL right there, so tests can
# crash a real `paralon payouts send --once` where it hurts most. Unset in production.
FAULT_ENV = "PARALON_PAYOUT_FAULT"
AFTER_STORE, AFTER_BROADCAST = "after_store", "after_broadcast"

ERC20_ABI = [
    {"type": "function", "name": "transfer", "stateMutability": "nonpayable",
     "inputs": [{"name": "to", "type": "address"}, {"name": "value", "type": "uint256"}], "outputs": [{"name": "", "type": "bool"}]},
    {"type": "function", "name": "balanceOf", "stateMutability": "view",
     "inputs": [{"name": "owner", "type": "address"}], "outputs": [{"name": "", "type": "uint256"}]},
]
_ERC20 = Web3().eth.contract(abi=ERC20_ABI)
# How nodes say a broadcast transaction is in their pool already (geth, anvil, nethermind, erigon) ...
_ALREADY_KNOWN = ("already known", "already imported", "known transaction", "alreadyknown", "already exists")
# ... and that its nonce is spent: one of the payout's transactions (or another) was mined.
_NONCE_SPENT = ("nonce too low", "nonce is too low", "oldnonce", "nonce has already been used")


class PayoutChainNotConfigured(InvalidInput):
    code = "payout_chain_not_configured"


class InexactPayoutAmount(LedgerError):
    """The payout's net amount is not a whole number of the token's smallest unit: never rounded, never sent."""

    code = "payout_amount_inexact"


def wallet_address(wallet_key: str) -> str:
    return Account.from_key(wallet_key).address


def require_configured(settings: PayoutChainSettings) -> None:
    if missing := settings.missing():
        raise PayoutChainNotConfigured(f"USDC payouts are not configured: set {', '.join(missing)}")


def connect(settings: PayoutChainSettings) -> Web3:
    require_configured(settings)
    return Web3(Web3.HTTPProvider(settings.rpc_url, request_kwargs={"timeout": CHAIN_RPC_TIMEOUT_S}))


def token_raw_amount(net_nano_usd: int, decimals: int) -> int:
    """Nano-USD to the token's smallest unit, exactly: an amount that does not divide is refused."""
    unit = nano_usd_per_unit(decimals)
    if net_nano_usd <= 0 or net_nano_usd % unit:
        raise InexactPayoutAmount(f"{net_nano_usd} nano-USD is not a whole number of units of a {decimals}-decimal token")
    return net_nano_usd // unit


def transfer_data(destination: str, raw_amount: int) -> str:
    return _ERC20.encode_abi("transfer", args=[Web3.to_checksum_address(destination), raw_amount])


@dataclass
class SendReport:
    chain_id: int
    head_block: int
    wallet: str
    signed: int = 0  # payouts signed for the first time (stored, then broadcast)
    replaced: int = 0  # transactions re-signed at a higher fee, same nonce
    broadcast: int = 0  # stored transactions the node accepted or already had
    settled: int = 0
    failed: int = 0
    reorganised: int = 0  # transfers whose block left the chain, broadcast again
    waiting_for_funds: int = 0
    waiting_for_destination: int = 0
    errors: int = 0  # payouts a node or database error left for the next run
    token_balance_raw: str = "0"
    gas_balance_wei: str = "0"


@dataclass(frozen=True)
class StoredTx:
    tx_hash: str
    nonce: int
    raw_transaction: bytes
    signed_at: datetime
    broadcast_at: datetime | None

    @property
    def fields(self) -> dict:
        """The signed transaction's own fields, as signed (nonce, gas, fees, data)."""
        decoded = TypedTransaction.from_bytes(HexBytes(self.raw_transaction)).as_dict()
        return {k: v for k, v in decoded.items() if k not in ("v", "r", "s")}


@dataclass
class _Funds:
    """The wallet's balances, less what signed transactions not yet seen mined will take."""

    token_balance_raw: int
    gas_balance_wei: int
    token_available_raw: int
    gas_available_wei: int
    waiting: int = 0


@dataclass
class _Run:
    engine: Engine
    w3: Web3
    settings: PayoutChainSettings
    account: LocalAccount = field(repr=False)  # holds the key
    chain_id: int
    head: int
    now: datetime
    report: SendReport
    _fees: tuple[int, int] | None = None

    @property
    def address(self) -> str:
        return self.account.address

    def fees(self) -> tuple[int, int]:
        """(maxPriorityFeePerGas, maxFeePerGas) the chain asks for now; read once per run."""
        if self._fees is None:
            tip = self.w3.eth.max_priority_fee
            base = self.w3.eth.get_block("latest").get("baseFeePerGas", 0)
            self._fees = (tip, base * PAYOUT_BASE_FEE_MULTIPLIER + tip)
        return self._fees


def send_once(engine: Engine, w3: Web3, settings: PayoutChainSettings, now: datetime | None = None) -> SendReport:
    """One bounded run: follow every payout with a stored transaction (receipts,
    confirmations, settlement, re-broadcast, replacement), then sign and send
    the requested ones the wallet can pay."""
    require_configured(settings)
    account = Account.from_key(settings.wallet_key)
    chain_id, head = w3.eth.chain_id, w3.eth.block_number
    run = _Run(engine, w3, settings, account, chain_id, head, now or utc_now(), SendReport(chain_id, head, account.address))
    _ensure_wallet(run)
    for payout_id in _with_transactions(run):
        _guarded(run, payout_id, _follow)
    funds = _read_funds(run)
    for payout_id in _to_sign(run):
        if run.report.signed >= PAYOUTS_SIGNED_PER_RUN_MAX:
            break
        _guarded(run, payout_id, lambda r, p: _sign_and_send(r, p, funds))
    _record_funds(run, funds)
    return run.report


def _guarded(run: _Run, payout_id: int, step) -> None:
    """One payout's step; a node or database failure leaves it for the next run, and the others go on."""
    try:
        step(run, payout_id)
    except Exception:  # whatever failed, what is stored is the truth the next run starts from
        log.exception("payout %s: left for the next run", payout_id)
        run.report.errors += 1


def _fault_point(name: str) -> None:
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


# --- The wallet -------------------------------------------------------------------
def _wallet_key(run: _Run) -> tuple:
    w = payout_wallets.c
    return w.chain_id == run.chain_id, w.address == run.address


def _ensure_wallet(run: _Run) -> None:
    """The wallet's row, from the chain's pending nonce when it is new."""
    with run.engine.connect() as conn:
        if conn.execute(select(payout_wallets.c.next_nonce).where(*_wallet_key(run))).first() is not None:
            return
    pending = run.w3.eth.get_transaction_count(run.address, "pending")
    try:
        with run.engine.begin() as conn:
            conn.execute(payout_wallets.insert().values(chain_id=run.chain_id, address=run.address, next_nonce=pending))
    except IntegrityError:  # another sender made it meanwhile
        pass


def _read_funds(run: _Run) -> _Funds:
    token_raw = run.w3.eth.contract(address=run.settings.token.address, abi=ERC20_ABI).functions.balanceOf(run.address).call()
    gas_wei = run.w3.eth.get_balance(run.address)
    reserved_raw = reserved_wei = 0
    for raw_amount, newest in _unmined(run):
        reserved_raw += raw_amount
        reserved_wei += newest["gas"] * newest["maxFeePerGas"]
    run.report.token_balance_raw, run.report.gas_balance_wei = str(token_raw), str(gas_wei)
    return _Funds(token_raw, gas_wei, token_raw - reserved_raw, gas_wei - reserved_wei)


def _unmined(run: _Run) -> list[tuple[int, dict]]:
    """(raw amount, newest transaction's fields) of each payout signed and not seen mined:
    the balance of the latest block has not paid them yet."""
    p, t = payouts.c, payout_transactions.c
    with run.engine.connect() as conn:
        rows = conn.execute(select(p.id, p.raw_amount, t.tx_hash, t.nonce, t.raw_transaction, t.signed_at, t.broadcast_at)
                            .join(payout_transactions, t.payout_id == p.id)
                            .where(p.rail == po.USDC, p.state.in_(po.IN_FLIGHT), p.block_number.is_(None), t.chain_id == run.chain_id)
                            .order_by(p.id, t.max_fee_per_gas_wei, t.signed_at)).all()
    newest = {row.id: row for row in rows}
    return [(int(row.raw_amount), _stored_of(row).fields) for row in newest.values()]


def _record_funds(run: _Run, funds: _Funds) -> None:
    with run.engine.begin() as conn:
        conn.execute(update(payout_wallets).where(*_wallet_key(run)).values(
            token_balance_raw=str(funds.token_balance_raw), gas_balance_wei=str(funds.gas_balance_wei),
            payouts_waiting_for_funds=funds.waiting, balances_at=run.now))


# --- Payouts with a stored transaction ------------------------------------------------
def _with_transactions(run: _Run) -> list[int]:
    p, t = payouts.c, payout_transactions.c
    with run.engine.connect() as conn:
        return list(conn.execute(select(p.id).where(
            p.rail == po.USDC, p.state.in_(po.IN_FLIGHT),
            exists().where(t.payout_id == p.id, t.chain_id == run.chain_id),
        ).order_by(p.id).limit(PAYOUTS_LOOKED_AT_PER_RUN_MAX)).scalars())


def _stored_of(row) -> StoredTx:
    return StoredTx(row.tx_hash, row.nonce, bytes(row.raw_transaction), row.signed_at, row.broadcast_at)


def _stored(conn: Connection, run: _Run, payout_id: int) -> list[StoredTx]:
    """The payout's transactions, oldest first: each replacement pays more than the one before."""
    t = payout_transactions.c
    rows = conn.execute(select(payout_transactions).where(t.payout_id == payout_id, t.chain_id == run.chain_id)
                        .order_by(t.max_fee_per_gas_wei, t.signed_at)).all()
    return [_stored_of(row) for row in rows]


def _follow(run: _Run, payout_id: int) -> None:
    with run.engine.connect() as conn:
        txs = _stored(conn, run, payout_id)
    found = _mined(run, txs)
    if found is not None:
        _on_mined(run, payout_id, *found)
        return
    _forget_vanished_block(run, payout_id)
    if _nonce_spent_by_another(run, txs[0].nonce):
        _fail(run, payout_id, f"nonce {txs[0].nonce} was spent by a transaction that is not this payout's: "
                              "none of its transactions can be mined any more")
        return
    newest = txs[-1]
    if _due_for_replacement(run, newest, len(txs)):
        newest = _replace(run, payout_id, newest)
    _broadcast(run, payout_id, newest)


def _mined(run: _Run, txs: list[StoredTx]) -> tuple[StoredTx, dict] | None:
    """The one of them mined in a block the chain still has, with its receipt (they share
    a nonce: at most one can be)."""
    for tx in txs:
        try:
            receipt = run.w3.eth.get_transaction_receipt(tx.tx_hash)
        except TransactionNotFound:
            continue
        if receipt is None or receipt.get("blockNumber") is None:
            continue
        block = run.w3.eth.get_block(receipt["blockNumber"])
        if block is None or _hex(block["hash"]) != _hex(receipt["blockHash"]):
            continue  # a receipt from a block the chain no longer has
        return tx, receipt
    return None


def _on_mined(run: _Run, payout_id: int, tx: StoredTx, receipt: dict) -> None:
    """Confirmations kept up to date; N deep, settled (or failed, when it reverted)."""
    block_number = receipt["blockNumber"]
    confirmations = max(run.head, block_number) - block_number + 1
    succeeded = receipt["status"] == EVM_RECEIPT_STATUS_SUCCESS
    with run.engine.begin() as conn:
        row = po.payout_row(conn, payout_id)
        if row["state"] not in po.IN_FLIGHT:
            return
        if succeeded and (row["state"] == po.REQUESTED or row["reference"] != tx.tx_hash):
            po.record_sent(conn, payout_id, tx.tx_hash, _sent_meta(tx.nonce, row["raw_amount"]), now=run.now)
        conn.execute(update(payouts).where(payouts.c.id == payout_id, payouts.c.state.in_(po.IN_FLIGHT))
                     .values(block_number=block_number, confirmations=confirmations))
        if confirmations < run.settings.confirmations:
            return
        if succeeded:
            if po.settle(conn, payout_id, tx.tx_hash, now=run.now) is not None:
                run.report.settled += 1
                log.info("payout %s settled: %s in block %s, %s confirmations", payout_id, tx.tx_hash, block_number, confirmations)
        # N deep, its nonce is spent for good: no other transaction of it can be mined.
        elif po.fail(conn, payout_id, f"transfer {tx.tx_hash} reverted in block {block_number}", now=run.now) is not None:
            run.report.failed += 1
            log.warning("payout %s failed back to earnings: %s reverted in block %s", payout_id, tx.tx_hash, block_number)


def _forget_vanished_block(run: _Run, payout_id: int) -> None:
    """It was seen mined and is not any more: its block left the chain."""
    with run.engine.begin() as conn:
        gone = conn.execute(select(payouts.c.block_number).where(payouts.c.id == payout_id)).scalar()
        if gone is None:
            return
        conn.execute(update(payouts).where(payouts.c.id == payout_id).values(block_number=None, confirmations=0))
    run.report.reorganised += 1
    log.warning("payout %s: block %s of its transfer left the chain; its stored transaction is broadcast again", payout_id, gone)


def _nonce_spent_by_another(run: _Run, nonce: int) -> bool:
    """The wallet's nonce at the block N deep has passed it, and none of the payout's
    transactions is mined (asked just before): none of them ever can be."""
    confirmed_block = run.head - run.settings.confirmations + 1
    if confirmed_block < 0:
        return False
    try:
        return run.w3.eth.get_transaction_count(run.address, confirmed_block) > nonce
    except (Web3RPCError, ValueError):  # a node that keeps no state that old cannot say: wait
        return False


def _fail(run: _Run, payout_id: int, reason: str) -> None:
    with run.engine.begin() as conn:
        if po.fail(conn, payout_id, reason, now=run.now) is not None:
            run.report.failed += 1
            log.warning("payout %s failed back to earnings: %s", payout_id, reason)


def _due_for_replacement(run: _Run, newest: StoredTx, signed_count: int) -> bool:
    sent_at = newest.broadcast_at or newest.signed_at
    if run.now - sent_at < timedelta(seconds=run.settings.replace_after_s):
        return False
    if signed_count > PAYOUT_REPLACEMENTS_MAX:
        log.error("nonce %s: replaced %s times and still not mined; broadcast again as it is", newest.nonce, signed_count - 1)
        return False
    return True


def _bumped(fee_wei: int) -> int:
    return -(-fee_wei * PAYOUT_FEE_BUMP_NUMERATOR // PAYOUT_FEE_BUMP_DENOMINATOR)  # rounded up


def _replace(run: _Run, payout_id: int, newest: StoredTx) -> StoredTx:
    """The same transaction and nonce at a higher fee, stored before it is broadcast."""
    fields = newest.fields
    tip_now, max_fee_now = run.fees()
    tip = max(_bumped(fields["maxPriorityFeePerGas"]), tip_now)
    max_fee = max(_bumped(fields["maxFeePerGas"]), max_fee_now, tip)
    if run.w3.eth.get_balance(run.address) < fields["gas"] * max_fee:
        log.warning("payout %s: not enough gas in %s to replace %s at %s wei per gas; broadcast again as it is",
                    payout_id, run.address, newest.tx_hash, max_fee)
        return newest
    signed = run.account.sign_transaction(fields | {"maxPriorityFeePerGas": tip, "maxFeePerGas": max_fee})
    with run.engine.begin() as conn:
        conn.execute(select(payouts.c.id).where(payouts.c.id == payout_id).with_for_update())
        latest = _stored(conn, run, payout_id)[-1]
        if latest.tx_hash != newest.tx_hash:
            return latest  # another sender replaced it meanwhile
        replacement = _insert_tx(conn, run, payout_id, fields["nonce"], max_fee, signed)
    run.report.replaced += 1
    log.info("payout %s: %s not mined after %s s, replaced by %s (nonce %s, max fee %s wei per gas)",
             payout_id, newest.tx_hash, run.settings.replace_after_s, replacement.tx_hash, replacement.nonce, max_fee)
    _fault_point(AFTER_STORE)
    return replacement


def _insert_tx(conn: Connection, run: _Run, payout_id: int, nonce: int, max_fee_wei: int, signed) -> StoredTx:
    stored = StoredTx(_hex(signed.hash), nonce, bytes(signed.raw_transaction), run.now, None)
    conn.execute(payout_transactions.insert().values(
        tx_hash=stored.tx_hash, payout_id=payout_id, chain_id=run.chain_id, nonce=nonce, max_fee_per_gas_wei=max_fee_wei,
        raw_transaction=stored.raw_transaction, signed_at=stored.signed_at))
    return stored


def _broadcast(run: _Run, payout_id: int, tx: StoredTx) -> None:
    """The stored bytes to the node; then broadcast_at and PayoutSent under its hash."""
    try:
        run.w3.eth.send_raw_transaction(tx.raw_transaction)
    except Web3RPCError as exc:
        answer = str(exc).lower()
        if any(known in answer for known in _NONCE_SPENT):
            _after_nonce_spent(run, payout_id)
            return
        if not any(known in answer for known in _ALREADY_KNOWN):
            log.warning("payout %s: the node refused %s: %s; tried again next run", payout_id, tx.tx_hash, exc)
            run.report.errors += 1
            return
    _fault_point(AFTER_BROADCAST)
    with run.engine.begin() as conn:
        t = payout_transactions.c
        conn.execute(update(payout_transactions).where(t.tx_hash == tx.tx_hash, t.broadcast_at.is_(None)).values(broadcast_at=run.now))
        row = po.payout_row(conn, payout_id)
        if row["state"] == po.REQUESTED or row["reference"] != tx.tx_hash:
            po.record_sent(conn, payout_id, tx.tx_hash, _sent_meta(tx.nonce, row["raw_amount"]), now=run.now)
    run.report.broadcast += 1


def _after_nonce_spent(run: _Run, payout_id: int) -> None:
    """'nonce too low': one of its transactions may just have been mined; its receipt says."""
    with run.engine.connect() as conn:
        txs = _stored(conn, run, payout_id)
    found = _mined(run, txs)
    if found is not None:
        _on_mined(run, payout_id, *found)
    else:
        log.info("payout %s: nonce %s is spent and none of its transactions is mined yet; looked at again next run",
                 payout_id, txs[0].nonce)


def _sent_meta(nonce: int, raw_amount) -> dict:
    return {"nonce": nonce, "raw_amount": str(int(raw_amount))}


# --- Requested payouts, signed and sent --------------------------------------------
def _to_sign(run: _Run) -> list[int]:
    p, t = payouts.c, payout_transactions.c
    with run.engine.connect() as conn:
        return list(conn.execute(select(p.id).where(
            p.rail == po.USDC, p.state == po.REQUESTED, ~exists().where(t.payout_id == p.id),
        ).order_by(p.id).limit(PAYOUTS_LOOKED_AT_PER_RUN_MAX)).scalars())


def _sign_and_send(run: _Run, payout_id: int, funds: _Funds) -> None:
    with run.engine.connect() as conn:
        row = po.payout_row(conn, payout_id)
        why = po.destination_problem(conn, row, run.now)
    if why is not None:
        run.report.waiting_for_destination += 1
        log.info("payout %s waits: %s", payout_id, why)
        return
    raw = token_raw_amount(row["amount_nano_usd"] - row["fee_nano_usd"], run.settings.token.decimals)
    if funds.token_available_raw < raw:
        _wait_for_funds(run, funds, payout_id, raw, None)
        return
    data = transfer_data(row["destination"], raw)
    estimate = run.w3.eth.estimate_gas({"from": run.address, "to": run.settings.token.address, "data": data})
    gas = estimate + estimate * PAYOUT_GAS_MARGIN_PERCENT // PERCENT
    tip, max_fee = run.fees()
    if funds.gas_available_wei < gas * max_fee:
        _wait_for_funds(run, funds, payout_id, raw, gas * max_fee)
        return
    stored = _store_signed(run, payout_id, raw, {"to": run.settings.token.address, "data": data, "gas": gas,
                                                  "maxPriorityFeePerGas": tip, "maxFeePerGas": max_fee})
    if stored is None:
        return
    funds.token_available_raw -= raw
    funds.gas_available_wei -= gas * max_fee
    run.report.signed += 1
    _fault_point(AFTER_STORE)
    _broadcast(run, payout_id, stored)


def _store_signed(run: _Run, payout_id: int, raw: int, transfer: dict) -> StoredTx | None:
    """Nonce, signature and the signed bytes in one transaction, under the wallet's row
    lock; None when another sender signed it meanwhile or its destination changed."""
    with run.engine.begin() as conn:
        next_nonce = conn.execute(select(payout_wallets.c.next_nonce).where(*_wallet_key(run)).with_for_update()).scalar_one()
        row = conn.execute(select(payouts).where(payouts.c.id == payout_id).with_for_update()).one()._mapping
        signed_already = conn.execute(select(payout_transactions.c.tx_hash).where(payout_transactions.c.payout_id == payout_id)).first()
        if row["state"] != po.REQUESTED or signed_already or po.destination_problem(conn, row, run.now, lock=True):
            return None
        nonce = max(next_nonce, run.w3.eth.get_transaction_count(run.address, "pending"))
        signed = run.account.sign_transaction({"type": EVM_DYNAMIC_FEE_TX_TYPE, "chainId": run.chain_id, "nonce": nonce, "value": 0, **transfer})
        stored = _insert_tx(conn, run, payout_id, nonce, transfer["maxFeePerGas"], signed)
        conn.execute(update(payouts).where(payouts.c.id == payout_id).values(raw_amount=raw))
        conn.execute(update(payout_wallets).where(*_wallet_key(run)).values(next_nonce=nonce + 1))
    log.info("payout %s signed: %s, nonce %s, %s raw to %s", payout_id, stored.tx_hash, nonce, raw, row["destination"])
    return stored


def _wait_for_funds(run: _Run, funds: _Funds, payout_id: int, raw: int, gas_cost_wei: int | None) -> None:
    funds.waiting += 1
    run.report.waiting_for_funds += 1
    symbol = run.settings.token.symbol
    if gas_cost_wei is None:
        log.warning("payout %s waits for funds: it needs %s raw %s, the hot wallet %s has %s free (%s in all)",
                    payout_id, raw, symbol, run.address, funds.token_available_raw, funds.token_balance_raw)
    else:
        log.warning("payout %s waits for funds: its gas may cost %s wei, the hot wallet %s has %s wei free (%s in all)",
                    payout_id, gas_cost_wei, run.address, funds.gas_available_wei, funds.gas_balance_wei)


def _hex(value) -> str:
    text = value.hex() if hasattr(value, "hex") else str(value)
    return text if text.startswith("0x") else "0x" + text
