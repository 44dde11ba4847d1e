"""Anchors on the EVM chain the deposits use: a 0-value transaction from the
anchor wallet to itself whose data is `paralon-anchor`, the seq (8 bytes, big
endian) and the event's hash (32 bytes). Once mined, nobody with the database
(or the anchor file) can change it; whoever holds the key can only add more.

Read back by the transaction hashes the anchor file records, or by scanning a
bounded range of blocks for the wallet's transactions (when the file is lost)."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from eth_account import Account
from web3 import Web3
from web3.exceptions import TransactionNotFound

from app.limits import (
    ANCHOR_RECEIPT_TIMEOUT_S,
    ANCHOR_SCAN_BLOCKS_MAX,
    ANCHOR_SEQ_BYTES,
    CHAIN_RPC_TIMEOUT_S,
    EVM_RECEIPT_STATUS_SUCCESS,
)
from ledger.anchors import Anchor
from ledger.limits import SHA256_BYTES

PREFIX = b"paralon-anchor"
DATA_BYTES = len(PREFIX) + ANCHOR_SEQ_BYTES + SHA256_BYTES


@dataclass(frozen=True)
class ChainAnchorSettings:
    rpc_url: str = field(repr=False)  # may hold an API key
    wallet_key: str = field(repr=False)

    @property
    def address(self) -> str:
        return Account.from_key(self.wallet_key).address


def connect(settings: ChainAnchorSettings) -> Web3:
    return Web3(Web3.HTTPProvider(settings.rpc_url, request_kwargs={"timeout": CHAIN_RPC_TIMEOUT_S}))


def encode(seq: int, event_hash: bytes) -> bytes:
    return PREFIX + seq.to_bytes(ANCHOR_SEQ_BYTES, "big") + event_hash


def decode(data: bytes) -> tuple[int, bytes] | None:
    """(seq, hash) from a transaction's data, or None when it is no anchor."""
    if len(data) != DATA_BYTES or not data.startswith(PREFIX):
        return None
    body = data[len(PREFIX):]
    return int.from_bytes(body[:ANCHOR_SEQ_BYTES], "big"), body[ANCHOR_SEQ_BYTES:]


def send(w3: Web3, settings: ChainAnchorSettings, seq: int, event_hash: bytes) -> tuple[int, str]:
    """Send the anchor and wait until it is mined; (chain id, transaction hash)."""
    account = Account.from_key(settings.wallet_key)
    chain_id = w3.eth.chain_id
    tx = {"from": account.address, "to": account.address, "value": 0, "data": encode(seq, event_hash),
          "nonce": w3.eth.get_transaction_count(account.address, "pending"), "chainId": chain_id}
    tx |= {"gas": w3.eth.estimate_gas(tx), "gasPrice": w3.eth.gas_price}
    signed = account.sign_transaction(tx)
    tx_hash = w3.eth.send_raw_transaction(signed.raw_transaction)
    receipt = w3.eth.wait_for_transaction_receipt(tx_hash, timeout=ANCHOR_RECEIPT_TIMEOUT_S)
    if receipt["status"] != EVM_RECEIPT_STATUS_SUCCESS:
        raise RuntimeError(f"anchor transaction {_hex(tx_hash)} failed on chain {chain_id}")
    return chain_id, _hex(tx_hash)


def read_tx(w3: Web3, settings: ChainAnchorSettings, chain_id: int, tx_hash: str) -> Anchor:
    """The anchor a mined transaction of the anchor wallet carries; ValueError otherwise."""
    try:
        tx = w3.eth.get_transaction(tx_hash)
    except TransactionNotFound:
        raise ValueError(f"transaction {tx_hash} is not on chain {chain_id}") from None
    anchor = _anchor_of(chain_id, tx, settings.address, None)  # its time is the file's; one call per anchor, not two
    if anchor is None:
        raise ValueError(f"transaction {tx_hash} is no anchor of {settings.address}")
    return anchor


def scan(w3: Web3, settings: ChainAnchorSettings, chain_id: int, from_block: int) -> tuple[list[Anchor], int]:
    """The anchor wallet's anchors in at most ANCHOR_SCAN_BLOCKS_MAX blocks from
    `from_block`; (anchors, the last block read)."""
    to_block = min(w3.eth.block_number, from_block + ANCHOR_SCAN_BLOCKS_MAX - 1)
    anchors = []
    for number in range(from_block, to_block + 1):
        block = w3.eth.get_block(number, full_transactions=True)
        for tx in block["transactions"]:
            anchor = _anchor_of(chain_id, tx, settings.address, datetime.fromtimestamp(block["timestamp"], UTC))
            if anchor is not None:
                anchors.append(anchor)
    return anchors, to_block


def _anchor_of(chain_id: int, tx, address: str, mined_at: datetime | None) -> Anchor | None:
    """Only a mined transaction from the wallet to itself counts: anyone may send
    the same data to the wallet, nobody else can send it from there."""
    if tx.get("blockNumber") is None or tx["from"] != address or tx.get("to") != address:
        return None
    decoded = decode(bytes(tx["input"]))
    if decoded is None:
        return None
    seq, event_hash = decoded
    return Anchor(seq, event_hash, mined_at, f"chain {chain_id} tx {_hex(tx['hash'])}")


def _hex(value) -> str:
    text = value.hex() if hasattr(value, "hex") else str(value)
    return text if text.startswith("0x") else "0x" + text
