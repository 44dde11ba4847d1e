"""Stablecoin top-ups: the scanner that credits ERC-20 `Transfer`s to the
customers' deposit addresses (app/payments/deposits.py) after N confirmations.

Exactly once per (chain, transaction, log index): the credit is appended in
the transaction that records it on the transfer row. The scanner keeps the
hashes of recent blocks; when the chain reorganises, transfers in the blocks
that vanished are forgotten (never credited), and one already credited is
reversed. Scans are bounded in blocks and go on from where they stopped.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from eth_abi import encode
from eth_abi.exceptions import DecodingError
from sqlalchemy import Connection, Engine, delete, select, update
from web3 import Web3
from web3.exceptions import LogTopicError, MismatchedABI
from web3.types import EventData

from app import outbox
from app.limits import CHAIN_RPC_TIMEOUT_S, CRYPTO_REORG_DEPTH_BLOCKS, CRYPTO_SCAN_BLOCKS_MAX
from app.payments.chain_settings import CryptoSettings
from app.payments.deposits import CryptoNotConfigured
from app.payments.schema import crypto_blocks, crypto_deposit_addresses, crypto_scan_positions, crypto_transfers
from ledger import commands as cmd
from ledger.accounts import create_system_account
from ledger.money import nano_usd_per_unit
from ledger.store import append_one

# ERC-20's Transfer event, decoded by web3 from its ABI (a log of any other shape is not one).
TRANSFER_EVENT_ABI = {
    "type": "event", "name": "Transfer", "anonymous": False,
    "inputs": [{"name": "from", "type": "address", "indexed": True}, {"name": "to", "type": "address", "indexed": True},
               {"name": "value", "type": "uint256", "indexed": False}],
}
TRANSFER_EVENT = Web3().eth.contract(abi=[TRANSFER_EVENT_ABI]).events.Transfer()
logger = logging.getLogger(__name__)


def connect(settings: CryptoSettings) -> Web3:
    if not settings.rpc_url:
        raise CryptoNotConfigured("crypto deposits need PARALON_CHAIN_RPC_URL")
    return Web3(Web3.HTTPProvider(settings.rpc_url, request_kwargs={"timeout": CHAIN_RPC_TIMEOUT_S}))


@dataclass
class ScanReport:
    chain_id: int
    from_block: int
    to_block: int
    transfers_seen: int = 0
    credited: int = 0
    forgotten: int = 0  # seen in blocks that vanished, never credited
    reversed: int = 0  # credited, then their block vanished


def scan_once(engine: Engine, w3: Web3, settings: CryptoSettings) -> ScanReport:
    """One bounded scan. The invoices of what it credits wait in the outbox for
    the caller to dispatch (`app.outbox.dispatch`)."""
    if not settings.tokens:
        raise CryptoNotConfigured("crypto deposits need PARALON_CRYPTO_TOKENS")
    chain_id, head = w3.eth.chain_id, w3.eth.block_number
    counter = f"external:chain:{chain_id}"
    with engine.begin() as conn:
        create_system_account(conn, counter, f"Stablecoin deposits on chain {chain_id}")
        next_block = conn.execute(select(crypto_scan_positions.c.next_block).where(crypto_scan_positions.c.chain_id == chain_id)).scalar()
    if next_block is None:
        next_block = settings.start_block
    report = ScanReport(chain_id, next_block, next_block - 1)
    next_block = _undo_reorganisation(engine, w3, chain_id, next_block, report)
    to_block = min(head, next_block + CRYPTO_SCAN_BLOCKS_MAX - 1)
    report.from_block, report.to_block = next_block, to_block
    with engine.begin() as conn:
        if to_block >= next_block:
            _record_transfers(conn, w3, settings, chain_id, next_block, to_block, report)
            _remember_blocks(conn, w3, chain_id, max(next_block, head - CRYPTO_REORG_DEPTH_BLOCKS + 1), to_block)
        _set_position(conn, chain_id, to_block + 1)
        _credit_confirmed(conn, chain_id, head - settings.confirmations + 1, counter, report)
    return report


def _undo_reorganisation(engine: Engine, w3: Web3, chain_id: int, next_block: int, report: ScanReport) -> int:
    """Find the newest remembered block the chain still has; everything after it vanished."""
    with engine.begin() as conn:
        remembered = conn.execute(
            select(crypto_blocks.c.number, crypto_blocks.c.hash).where(crypto_blocks.c.chain_id == chain_id)
            .order_by(crypto_blocks.c.number.desc())
        ).all()
        fork = None
        for number, block_hash in remembered:
            if _hash_of(w3, number) == block_hash:
                fork = number
                break
        if not remembered or fork == remembered[0][0]:
            return next_block
        first_gone = (fork + 1) if fork is not None else remembered[-1][0]
        for transfer in conn.execute(select(crypto_transfers).where(crypto_transfers.c.chain_id == chain_id,
                                                                      crypto_transfers.c.block_number >= first_gone)).all():
            if transfer.credit_seq is not None:
                append_one(conn, cmd.ReverseEvent(transfer.credit_seq, f"chain {chain_id} reorganised: transfer {transfer.tx_hash}:{transfer.log_index} vanished",
                                               f"crypto:reverse:{chain_id}:{transfer.tx_hash}:{transfer.log_index}:{transfer.block_hash}"))
                report.reversed += 1
            else:
                report.forgotten += 1
        conn.execute(delete(crypto_transfers).where(crypto_transfers.c.chain_id == chain_id, crypto_transfers.c.block_number >= first_gone))
        conn.execute(delete(crypto_blocks).where(crypto_blocks.c.chain_id == chain_id, crypto_blocks.c.number >= first_gone))
        _set_position(conn, chain_id, first_gone)
    return first_gone


def _hash_of(w3: Web3, number: int) -> str | None:
    block = w3.eth.get_block(number)
    return _hex(block["hash"]) if block else None


def _hex(value) -> str:
    text = value.hex() if hasattr(value, "hex") else str(value)
    return text if text.startswith("0x") else "0x" + text


def _record_transfers(conn: Connection, w3: Web3, settings: CryptoSettings, chain_id: int, from_block: int, to_block: int,
                      report: ScanReport) -> None:
    owners = dict(conn.execute(select(crypto_deposit_addresses.c.address, crypto_deposit_addresses.c.account_id)).all())
    if not owners:
        return
    decimals = {t.address: t.decimals for t in settings.tokens}
    topics_to = ["0x" + encode(["address"], [address]).hex() for address in owners]
    logs = w3.eth.get_logs({"fromBlock": from_block, "toBlock": to_block, "address": list(decimals),
                            "topics": [TRANSFER_EVENT.topic, None, topics_to]})
    for log in logs:
        transfer = _decode_transfer(log)
        if transfer is None:
            continue
        token, to_address = Web3.to_checksum_address(transfer["address"]), Web3.to_checksum_address(transfer["args"]["to"])
        raw = transfer["args"]["value"]  # an int of up to 256 bits, kept exactly
        if token not in decimals or to_address not in owners or raw <= 0:
            continue
        key = {"chain_id": chain_id, "tx_hash": _hex(log["transactionHash"]), "log_index": log["logIndex"]}
        exists = conn.execute(select(crypto_transfers.c.tx_hash).where(*(crypto_transfers.c[k] == v for k, v in key.items()))).first()
        if exists:
            continue
        conn.execute(crypto_transfers.insert().values(
            **key, block_number=log["blockNumber"], block_hash=_hex(log["blockHash"]), token=token, to_address=to_address,
            account_id=owners[to_address], raw_amount=raw, amount_nano_usd=raw * nano_usd_per_unit(decimals[token]),
        ))
        report.transfers_seen += 1


def _decode_transfer(log) -> EventData | None:
    """The ERC-20 Transfer this log is, or None: a configured address may also emit
    logs of another shape under the same topic (an ERC-721 Transfer, a malformed value)."""
    try:
        return TRANSFER_EVENT.process_log(log)
    except (MismatchedABI, LogTopicError, DecodingError) as exc:
        logger.warning("log %s:%s of %s is not an ERC-20 Transfer: %s",
                       _hex(log["transactionHash"]), log["logIndex"], log["address"], exc)
        return None


def _remember_blocks(conn: Connection, w3: Web3, chain_id: int, from_block: int, to_block: int) -> None:
    for number in range(max(from_block, 0), to_block + 1):
        conn.execute(delete(crypto_blocks).where(crypto_blocks.c.chain_id == chain_id, crypto_blocks.c.number == number))
        conn.execute(crypto_blocks.insert().values(chain_id=chain_id, number=number, hash=_hash_of(w3, number)))
    conn.execute(delete(crypto_blocks).where(crypto_blocks.c.chain_id == chain_id, crypto_blocks.c.number < to_block - CRYPTO_REORG_DEPTH_BLOCKS))


def _set_position(conn: Connection, chain_id: int, next_block: int) -> None:
    if not conn.execute(update(crypto_scan_positions).where(crypto_scan_positions.c.chain_id == chain_id).values(next_block=next_block)).rowcount:
        conn.execute(crypto_scan_positions.insert().values(chain_id=chain_id, next_block=next_block))


def _credit_confirmed(conn: Connection, chain_id: int, confirmed_up_to: int, counter: str, report: ScanReport) -> None:
    due = conn.execute(select(crypto_transfers).where(
        crypto_transfers.c.chain_id == chain_id, crypto_transfers.c.credit_seq.is_(None),
        crypto_transfers.c.block_number <= confirmed_up_to,
    ).order_by(crypto_transfers.c.block_number, crypto_transfers.c.log_index)).all()
    for t in due:
        reference = f"chain:{chain_id}:tx:{t.tx_hash}:log:{t.log_index}:token:{t.token}:raw:{t.raw_amount}"
        result = append_one(conn, cmd.PurchaseCredits(t.account_id, t.amount_nano_usd, "crypto", reference, counter,
                                                   f"crypto:{chain_id}:{t.tx_hash}:{t.log_index}:{t.block_hash}"))
        conn.execute(update(crypto_transfers).where(crypto_transfers.c.chain_id == chain_id, crypto_transfers.c.tx_hash == t.tx_hash,
                                                    crypto_transfers.c.log_index == t.log_index).values(credit_seq=result.seq))
        outbox.add(conn, "paralon.issue_invoice", result.seq)
        report.credited += 1

