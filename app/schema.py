"""Tables of the edge: management tokens (who may do what through the API)."""
from __future__ import annotations

from sqlalchemy import BigInteger, Column, ForeignKey, LargeBinary, String, Table, Text, text

from ledger.schema import BigId, UTCDateTime, metadata

# Like API keys: shown once, kept as SHA-256 of 256 random bits.
management_tokens = Table(
    "management_tokens",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("role", String(16), nullable=False),
    Column("token_sha256", LargeBinary(32), nullable=False, unique=True),
    Column("token_prefix", String(16), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime),
)

stripe_checkout_sessions = Table(
    "stripe_checkout_sessions",
    metadata,
    Column("session_id", String(255), primary_key=True),
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    # Filled in when the payment is credited; refunds find the session by it.
    Column("payment_intent", String(255), unique=True),
    Column("credited_cents", BigInteger, nullable=False, server_default=text("0")),
    Column("refunded_cents", BigInteger, nullable=False, server_default=text("0")),  # Stripe's cumulative amount_refunded
)

# Every webhook event, stored before it is answered, processed once afterwards.
stripe_events = Table(
    "stripe_events",
    metadata,
    Column("event_id", String(255), primary_key=True),
    Column("event_type", String(100), nullable=False),
    Column("payload", Text, nullable=False),
    Column("received_at", UTCDateTime, nullable=False),
    Column("processed_at", UTCDateTime),
    Column("outcome", String(500)),
)

stripe_disputes = Table(
    "stripe_disputes",
    metadata,
    Column("dispute_id", String(255), primary_key=True),
    Column("session_id", String(255), ForeignKey("stripe_checkout_sessions.session_id"), nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("freeze_seq", BigInteger, nullable=False),  # the CreditsFrozen event a win reverses
    Column("status", String(16), nullable=False),  # frozen, won, lost
)
