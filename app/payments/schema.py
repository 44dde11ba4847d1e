"""The tables of card and stablecoin top-ups: Stripe's checkout sessions,
webhook events and disputes; each customer's deposit address, the chain
scanner's position, recent block hashes and the transfers it saw. And of
owners' payouts: where each owner is paid, each payout's state, the signed
transactions of the USDC rail and the hot wallet's nonce."""
from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Column, ForeignKey, Index, LargeBinary, Numeric, String, Table, Text, text

from app.limits import (
    DISPUTE_STATUS_CHARS_MAX,
    EVM_ADDRESS_CHARS,
    EVM_HASH_CHARS,
    PAYOUT_DESTINATION_CHARS_MAX,
    PAYOUT_FAILURE_CHARS_MAX,
    PAYOUT_RAIL_CHARS_MAX,
    PAYOUT_STATE_CHARS_MAX,
    STRIPE_ERROR_CHARS_MAX,
    STRIPE_EVENT_TYPE_CHARS_MAX,
    STRIPE_ID_CHARS_MAX,
    STRIPE_OUTCOME_CHARS_MAX,
    UINT256_DIGITS,
)
from ledger.column_types import BigId, partial_index
from ledger.limits import SHA256_BYTES
from ledger.schema import UTCDateTime, metadata

stripe_checkout_sessions = Table(
    "stripe_checkout_sessions",
    metadata,
    Column("session_id", String(STRIPE_ID_CHARS_MAX), primary_key=True),
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    # Filled in when the payment is credited; refunds find the session by it.
    Column("payment_intent", String(STRIPE_ID_CHARS_MAX), unique=True),
    Column("credited_cents", BigInteger, nullable=False, server_default=text("0")),
    Column("credit_seq", BigInteger),  # the CreditsPurchased event, which the invoice is for
    Column("refunded_cents", BigInteger, nullable=False, server_default=text("0")),  # Stripe's cumulative amount_refunded
)

# Every webhook event, stored before it is answered, processed once afterwards.
stripe_events = Table(
    "stripe_events",
    metadata,
    Column("event_id", String(STRIPE_ID_CHARS_MAX), primary_key=True),
    Column("event_type", String(STRIPE_EVENT_TYPE_CHARS_MAX), nullable=False),
    Column("payload", Text, nullable=False),
    Column("received_at", UTCDateTime, nullable=False),
    Column("processed_at", UTCDateTime),
    Column("outcome", String(STRIPE_OUTCOME_CHARS_MAX)),
    # Parked: processing failed; tried again from next_attempt_at (none after the last attempt).
    Column("attempts", BigInteger, nullable=False, server_default=text("0")),
    Column("parked_at", UTCDateTime),
    Column("next_attempt_at", UTCDateTime),
    Column("last_error", String(STRIPE_ERROR_CHARS_MAX)),
)

stripe_disputes = Table(
    "stripe_disputes",
    metadata,
    Column("dispute_id", String(STRIPE_ID_CHARS_MAX), primary_key=True),
    Column("session_id", String(STRIPE_ID_CHARS_MAX), ForeignKey("stripe_checkout_sessions.session_id"), nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("freeze_seq", BigInteger, nullable=False),  # the CreditsFrozen event a win reverses
    Column("status", String(DISPUTE_STATUS_CHARS_MAX), nullable=False),  # frozen, won, lost
)

# Stablecoin deposits: one address per customer, derived from the seed.
crypto_deposit_addresses = Table(
    "crypto_deposit_addresses",
    metadata,
    Column("account_id", BigInteger, ForeignKey("accounts.id"), primary_key=True),
    Column("address", String(EVM_ADDRESS_CHARS), nullable=False, unique=True),  # checksummed
    Column("derivation_index", BigInteger, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

# Where each chain's scan goes on from, and the hashes of recent blocks, to see a reorganisation.
crypto_scan_positions = Table(
    "crypto_scan_positions",
    metadata,
    Column("chain_id", BigInteger, primary_key=True),
    Column("next_block", BigInteger, nullable=False),
)
crypto_blocks = Table(
    "crypto_blocks",
    metadata,
    Column("chain_id", BigInteger, primary_key=True),
    Column("number", BigInteger, primary_key=True),
    Column("hash", String(EVM_HASH_CHARS), nullable=False),
)

crypto_transfers = Table(
    "crypto_transfers",
    metadata,
    Column("chain_id", BigInteger, primary_key=True),
    Column("tx_hash", String(EVM_HASH_CHARS), primary_key=True),
    Column("log_index", BigInteger, primary_key=True),
    Column("block_number", BigInteger, nullable=False),
    Column("block_hash", String(EVM_HASH_CHARS), nullable=False),
    Column("token", String(EVM_ADDRESS_CHARS), nullable=False),
    Column("to_address", String(EVM_ADDRESS_CHARS), nullable=False),
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("raw_amount", Numeric(UINT256_DIGITS, 0), nullable=False),  # exactly as on chain
    Column("amount_nano_usd", BigInteger, nullable=False),
    Column("credit_seq", BigInteger),  # the CreditsPurchased event, once confirmed
)


# Where an owner is paid on each rail. A changed destination receives nothing
# until `usable_from` (the cooldown); the one before it is kept for the record.
payout_destinations = Table(
    "payout_destinations",
    metadata,
    Column("owner_account_id", BigInteger, ForeignKey("accounts.id"), primary_key=True),
    Column("rail", String(PAYOUT_RAIL_CHARS_MAX), primary_key=True),
    Column("destination", String(PAYOUT_DESTINATION_CHARS_MAX), nullable=False),
    Column("previous_destination", String(PAYOUT_DESTINATION_CHARS_MAX)),
    Column("changed_at", UTCDateTime, nullable=False),
    Column("usable_from", UTCDateTime, nullable=False),
    Column("weekly", Boolean, nullable=False, server_default=text("false")),  # paid out every Monday above the minimum
)

# One row per payout, moved through its states in the transaction that appends
# its ledger event: requested -> sent -> settled, or failed from either.
payouts = Table(
    "payouts",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("owner_account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("rail", String(PAYOUT_RAIL_CHARS_MAX), nullable=False),
    Column("state", String(PAYOUT_STATE_CHARS_MAX), nullable=False),
    Column("amount_nano_usd", BigInteger, nullable=False),
    Column("fee_nano_usd", BigInteger, nullable=False),
    Column("destination", String(PAYOUT_DESTINATION_CHARS_MAX), nullable=False),
    Column("requested_at", UTCDateTime, nullable=False),
    Column("requested_seq", BigInteger),  # PayoutRequested
    Column("reference", String(PAYOUT_DESTINATION_CHARS_MAX)),  # the mined transaction's hash, or the Stripe transfer's id
    Column("raw_amount", Numeric(UINT256_DIGITS, 0)),  # what the rail moves, in its own smallest unit
    Column("sent_at", UTCDateTime),
    Column("block_number", BigInteger),  # where the transfer was last seen mined
    Column("confirmations", BigInteger, nullable=False, server_default=text("0")),
    Column("closed_at", UTCDateTime),
    Column("closed_seq", BigInteger),  # PayoutSettled or PayoutFailed
    Column("failure_reason", String(PAYOUT_FAILURE_CHARS_MAX)),
    # At most one payout in flight per owner and rail, whoever asks and however often.
    Index("ux_payouts_in_flight", "owner_account_id", "rail", unique=True, **partial_index("state IN ('requested', 'sent')")),
    Index("ix_payouts_owner", "owner_account_id", "id"),
)

# Every transaction signed for a payout, stored before it is broadcast. A
# payout has one nonce for life; a replacement (a higher fee) reuses it, so at
# most one of them can ever be mined.
payout_transactions = Table(
    "payout_transactions",
    metadata,
    Column("tx_hash", String(EVM_HASH_CHARS), primary_key=True),
    Column("payout_id", BigInteger, ForeignKey("payouts.id"), nullable=False, index=True),
    Column("chain_id", BigInteger, nullable=False),
    Column("nonce", BigInteger, nullable=False),
    Column("max_fee_per_gas_wei", Numeric(UINT256_DIGITS, 0), nullable=False),
    Column("raw_transaction", LargeBinary, nullable=False),
    Column("signed_at", UTCDateTime, nullable=False),
    Column("broadcast_at", UTCDateTime),
)

# The hot wallet's next nonce per chain, taken under a row lock with the signing;
# and what its last run found in it, for /metrics (the sender and the server are
# different processes). Balances are decimal text: exact on SQLite too, whose
# NUMERIC keeps only 64-bit integers exactly.
payout_wallets = Table(
    "payout_wallets",
    metadata,
    Column("chain_id", BigInteger, primary_key=True),
    Column("address", String(EVM_ADDRESS_CHARS), primary_key=True),
    Column("next_nonce", BigInteger, nullable=False),
    Column("token_balance_raw", String(UINT256_DIGITS)),  # the payout token, in its smallest unit
    Column("gas_balance_wei", String(UINT256_DIGITS)),
    Column("payouts_waiting_for_funds", BigInteger, nullable=False, server_default=text("0")),
    Column("balances_at", UTCDateTime),
)

# A settled payout's receipt, made at the first ask: served only as these bytes.
payout_receipts = Table(
    "payout_receipts",
    metadata,
    Column("payout_id", BigInteger, ForeignKey("payouts.id"), primary_key=True),
    Column("pdf_path", Text, nullable=False),
    Column("pdf_sha256", LargeBinary(SHA256_BYTES), nullable=False),
)
