"""What a customer sees of stablecoin top-ups: their own deposit address
(derived once from the seed, then kept) and the transfers to it that wait for
confirmations. The scanner that credits them is app/payments/crypto.py; this
side loads the wallet library only to derive an address."""
from __future__ import annotations

from sqlalchemy import Connection, Engine, select

from app.payments.chain_settings import CryptoSettings
from app.payments.schema import crypto_deposit_addresses, crypto_scan_positions, crypto_transfers
from ledger import commands as cmd
from ledger.accounts import require_kind
from ledger.errors import InvalidInput
from ledger.schema import utc_now


class CryptoNotConfigured(InvalidInput):
    code = "crypto_not_configured"


def derive_address(seed: str, index: int) -> str:
    """The address at BIP-44 path m/44'/60'/0'/0/index of the seed."""
    from eth_account import Account  # loaded only where a seed is set: about a second of imports

    Account.enable_unaudited_hdwallet_features()
    return Account.from_mnemonic(seed, account_path=f"m/44'/60'/0'/0/{index}").address


def deposit_address(engine: Engine, settings: CryptoSettings, account_id: int) -> str:
    """The customer's own address (derived once by HD path from the seed, then kept)."""
    if not settings.seed:
        raise CryptoNotConfigured("crypto deposits need PARALON_CRYPTO_SEED")
    with engine.begin() as conn:
        require_kind(conn, account_id, (cmd.CUSTOMER,), "deposit addresses are for customer accounts")
        known = conn.execute(select(crypto_deposit_addresses.c.address).where(crypto_deposit_addresses.c.account_id == account_id)).scalar()
        if known:
            return known
        address = derive_address(settings.seed, account_id)
        conn.execute(crypto_deposit_addresses.insert().values(account_id=account_id, address=address,
                                                              derivation_index=account_id, created_at=utc_now()))
        return address


def pending_deposits(conn: Connection, account_id: int, confirmations_required: int) -> list[dict]:
    """Transfers to the customer's address seen on chain and not yet credited, with the
    confirmations they have as of the last scan (the block the scan got to, not a node call)."""
    scanned = dict(conn.execute(select(crypto_scan_positions.c.chain_id, crypto_scan_positions.c.next_block)).all())
    rows = conn.execute(select(crypto_transfers).where(crypto_transfers.c.account_id == account_id,
                                                       crypto_transfers.c.credit_seq.is_(None))
                        .order_by(crypto_transfers.c.block_number, crypto_transfers.c.log_index))
    return [{"chain_id": r.chain_id, "tx_hash": r.tx_hash, "log_index": r.log_index, "block_number": r.block_number,
             "token": r.token, "amount_nano_usd": r.amount_nano_usd,
             "confirmations": max(0, scanned.get(r.chain_id, r.block_number) - r.block_number),
             "confirmations_required": confirmations_required} for r in rows]
