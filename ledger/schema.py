"""Tables, shared by the code and the Alembic revisions."""
from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    text,
)

from ledger.limits import (
    ACCOUNT_KIND_CHARS_MAX,
    ACCOUNT_NAME_CHARS_MAX,
    CONSUMER_NAME_CHARS_MAX,
    EMAIL_CHARS_MAX,
    EVENT_TYPE_CHARS_MAX,
    IDEMPOTENCY_KEY_CHARS_MAX,
    REPLICA_ID_CHARS_MAX,
    SHA256_BYTES,
    SYSTEM_CODE_CHARS_MAX,
)
from ledger.column_types import BigId, UTCDateTime, exact_text, partial_index

metadata = MetaData()

KeyText = exact_text(IDEMPOTENCY_KEY_CHARS_MAX)
Sha256 = LargeBinary(SHA256_BYTES)


def utc_now() -> datetime:
    return datetime.now(UTC)


LOW_BALANCE_THRESHOLD_CHECK = "low_balance_threshold_nano_usd > 0"

accounts = Table(
    "accounts",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("kind", String(ACCOUNT_KIND_CHARS_MAX), nullable=False),
    Column("name", String(ACCOUNT_NAME_CHARS_MAX), nullable=False),
    Column("email", String(EMAIL_CHARS_MAX)),
    Column("system_code", String(SYSTEM_CODE_CHARS_MAX), unique=True),  # platform and external accounts
    Column("created_at", UTCDateTime, nullable=False),
    # A customer's low-balance alert (app/low_balance.py): an email once the
    # available balance is below the threshold, then not again until it has
    # been back at or above it. Settings, not money: the balance is read from
    # account_balances.
    Column("low_balance_threshold_nano_usd", BigInteger,
           CheckConstraint(LOW_BALANCE_THRESHOLD_CHECK, name="ck_accounts_low_balance_threshold")),
    Column("low_balance_alerted_at", UTCDateTime),  # alerted for the current crossing; cleared when back above
    Column("low_balance_alert_claimed_at", UTCDateTime),  # a sender is at work; another waits for it or its timeout
)

# Inline projection: written in the same transaction as the events it comes from.
account_balances = Table(
    "account_balances",
    metadata,
    Column("account_id", BigInteger, ForeignKey("accounts.id"), primary_key=True),
    Column("balance_nano_usd", BigInteger, nullable=False, server_default=text("0")),
    Column("last_event_seq", BigInteger, nullable=False, server_default=text("0")),
    # Reservation bookkeeping, not money: the amount of every hold of this
    # customer that has been closed. Settlements add to it in the row they write
    # anyway; releases and expiries add to it without waiting for a flush.
    Column("holds_closed_nano_usd", BigInteger, nullable=False, server_default=text("0")),
)

# The one row every durable append locks: it serialises the hash chain and
# makes commit order equal sequence order.
ledger_head = Table(
    "ledger_head",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("last_seq", BigInteger, nullable=False),
    Column("last_hash", Sha256, nullable=False),
    # Appends put each event's postings in its own row (migration 0031), not
    # in ledger_postings: set once every replica reads them there.
    Column("postings_in_event_row", Boolean, nullable=False, server_default=text("false")),
)

ledger_events = Table(
    "ledger_events",
    metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("event_type", String(EVENT_TYPE_CHARS_MAX), nullable=False),
    Column("payload", Text, nullable=False),  # canonical JSON, exactly as hashed
    Column("idempotency_key", KeyText, nullable=False, unique=True),
    Column("content_digest", Sha256, nullable=False),  # of the command
    Column("reverses_seq", BigInteger),
    Column("recorded_at", UTCDateTime, nullable=False),
    Column("prev_hash", Sha256, nullable=False),  # raw bytes
    Column("hash", Sha256, nullable=False),
    # An event is reversed at most once; partial, so ordinary events add no index entry.
    Index("ux_ledger_events_reverses_seq", "reverses_seq", unique=True, **partial_index("reverses_seq IS NOT NULL")),
)

# No foreign keys on the hot append tables (postings, holds): a foreign-key
# check per row cost more than the rest of the insert, and every id written is
# checked under the append lock first; `ledger verify` re-checks them. Postings
# are read by event; per-account views are read models, which index themselves.
ledger_postings = Table(
    "ledger_postings",
    metadata,
    Column("event_seq", BigInteger, primary_key=True),
    Column("leg", Integer, primary_key=True, autoincrement=False),
    Column("account_id", BigInteger, nullable=False),
    Column("amount_nano_usd", BigInteger, nullable=False),
)

# Every event's postings, wherever they are kept: rows of ledger_postings, or
# the two arrays of the event's own row (PostgreSQL, migration 0031). A view,
# so it has its own metadata: nothing creates it but its migration.
views = MetaData()
ledger_event_postings = Table(
    "ledger_event_postings",
    views,
    Column("event_seq", BigInteger),
    Column("leg", Integer),
    Column("account_id", BigInteger),
    Column("amount_nano_usd", BigInteger),
)

# Active reservations beside the log, never hashed. A hold is deleted when it
# closes (settled: the RequestSettled event keeps it; released; expired), so
# the table holds only what is in flight and no index carries closed holds.
# No durable write locks a hold except the settlement that closes it.
holds = Table(
    "holds",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("account_id", BigInteger, nullable=False),
    Column("amount_nano_usd", BigInteger, nullable=False),
    Column("idempotency_key", KeyText, nullable=False, unique=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False),
    # The spend limit this hold also reserves against (an API key's), if any.
    Column("spend_limit_id", BigInteger),
    # What the hold's request has delivered so far and who produced it, recorded
    # while it runs (renewals): a hold that expires, or is found after a crash,
    # settles at this instead of being released. Zero: untouched, released.
    Column("capture_nano_usd", BigInteger, nullable=False, server_default=text("0")),
    Column("capture_owner_account_id", BigInteger),
    Column("capture_request_id", String(IDEMPOTENCY_KEY_CHARS_MAX)),
    Column("capture_meta", Text),  # canonical JSON of the settlement's metadata
    # The proxy replica that placed it (PARALON_REPLICA_ID): restarted after a
    # crash, it settles the holds it left at once instead of waiting for expiry.
    Column("replica_id", String(REPLICA_ID_CHARS_MAX)),
    # No index by expiry (migration 0032): renewals then rewrite a hold in
    # place, and the sweeper scans what is in flight.
    # No id is given twice (SQLite's AUTOINCREMENT, migration 0040): a replica
    # may still hold the id of a hold the sweeper deleted.
    sqlite_autoincrement=True,
)

# A spend limit (an API key's) is reserved like a customer's balance: placing a
# hold locks the first row and checks limit - spent - (placed - closed); the
# settlement that captures writes the second under the append lock, as
# account_balances is, so placing a hold never waits behind a flush.
spend_limit_holds = Table(
    "spend_limit_holds",
    metadata,
    Column("limit_id", BigInteger, primary_key=True, autoincrement=False),
    Column("limit_nano_usd", BigInteger, nullable=False),
    Column("holds_placed_nano_usd", BigInteger, nullable=False, server_default=text("0")),
)
spend_limit_usage = Table(
    "spend_limit_usage",
    metadata,
    Column("limit_id", BigInteger, primary_key=True, autoincrement=False),
    Column("spent_nano_usd", BigInteger, nullable=False, server_default=text("0")),
    Column("holds_closed_nano_usd", BigInteger, nullable=False, server_default=text("0")),
)

# One row per customer, locked by whoever places a hold (and by the rare durable
# debit that has no hold), so concurrent holds on one account serialise. No
# durable write locks it. A customer's active holds are
# holds_placed_nano_usd - account_balances.holds_closed_nano_usd: two numbers
# read in one statement, however many holds there have been.
customer_holds = Table(
    "customer_holds",
    metadata,
    Column("account_id", BigInteger, ForeignKey("accounts.id"), primary_key=True),
    Column("holds_placed_nano_usd", BigInteger, nullable=False, server_default=text("0")),
)

# Where each asynchronous consumer of the log has got to, written in the same
# transaction as the consumer's own writes.
consumer_positions = Table(
    "consumer_positions",
    metadata,
    Column("consumer", String(CONSUMER_NAME_CHARS_MAX), primary_key=True),
    Column("last_seq", BigInteger, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)

# What the scheduled verification last proved (one row, migration 0013): the
# chain up to verified_seq/verified_hash, and whether its last run passed.
ledger_verifications = Table(
    "ledger_verifications",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("verified_seq", BigInteger, nullable=False),
    Column("verified_hash", Sha256, nullable=False),
    Column("checked_at", UTCDateTime),
    Column("ok", Boolean),
    Column("problems_total", BigInteger, nullable=False, server_default=text("0")),
    Column("first_problem", Text),
)
