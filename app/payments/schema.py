"""The tables of card and stablecoin top-ups: Stripe's checkout sessions,
webhook events and disputes; each customer's deposit address, the chain
scanner's position, recent block hashes and the transfers it saw."""
from __future__ import annotations

from sqlalchemy import BigInteger, Column, ForeignKey, Numeric, String, Table, Text, text

from app.limits import (
    DISPUTE_STATUS_CHARS_MAX,
    EVM_ADDRESS_CHARS,
    EVM_HASH_CHARS,
    STRIPE_ERROR_CHARS_MAX,
    STRIPE_EVENT_TYPE_CHARS_MAX,
    STRIPE_ID_CHARS_MAX,
    STRIPE_OUTCOME_CHARS_MAX,
    UINT256_DIGITS,
)
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
