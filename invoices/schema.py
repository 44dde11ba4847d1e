"""Invoices and credit notes: gapless numbers per series and year."""
from __future__ import annotations

from sqlalchemy import BigInteger, Column, ForeignKey, Index, Integer, String, Table

from invoices.limits import (
    DAY_CHARS,
    DEPLOYMENT_ID_CHARS,
    DOCUMENT_KIND_CHARS_MAX,
    DOCUMENT_NUMBER_CHARS_MAX,
    GENERATION_STATUS_CHARS_MAX,
    MONTH_CHARS,
    PAYMENT_METHOD_CHARS_MAX,
    PDF_PATH_CHARS_MAX,
    REFERENCE_CHARS_MAX,
    SERIES_CHARS_MAX,
)
from ledger.limits import ACCOUNT_KIND_CHARS_MAX, EVENT_TYPE_CHARS_MAX, IDEMPOTENCY_KEY_CHARS_MAX, NAME_CHARS_MAX, REASON_CHARS_MAX
from ledger.schema import Sha256, UTCDateTime, metadata

# One row: this database's random id, made by its migration. Documents are
# stored under it, so deployments sharing a directory never share a file name.
deployment = Table(
    "deployment",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),  # always 1
    Column("deployment_id", String(DEPLOYMENT_ID_CHARS), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

invoice_counters = Table(
    "invoice_counters",
    metadata,
    Column("series", String(SERIES_CHARS_MAX), primary_key=True),
    Column("year", Integer, primary_key=True),
    Column("last_number", BigInteger, nullable=False),
)

invoices = Table(
    "invoices",
    metadata,
    Column("number", String(DOCUMENT_NUMBER_CHARS_MAX), primary_key=True),  # PAR-2026-000001
    Column("series", String(SERIES_CHARS_MAX), nullable=False),
    Column("year", Integer, nullable=False),
    Column("sequence", BigInteger, nullable=False),
    Column("kind", String(DOCUMENT_KIND_CHARS_MAX), nullable=False),  # invoice, credit_note
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("source_seq", BigInteger, nullable=False, unique=True),  # the ledger event invoiced: one document each
    Column("corrects_number", String(DOCUMENT_NUMBER_CHARS_MAX)),
    Column("amount_nano_usd", BigInteger, nullable=False),
    Column("payment_method", String(PAYMENT_METHOD_CHARS_MAX), nullable=False),
    Column("external_reference", String(REASON_CHARS_MAX), nullable=False),
    Column("issued_at", UTCDateTime, nullable=False),
    Column("pdf_path", String(PDF_PATH_CHARS_MAX)),
    Column("pdf_sha256", Sha256),
    Column("issued_event_seq", BigInteger),  # the InvoiceIssued event
    Column("emailed_at", UTCDateTime),
    Column("email_claimed_at", UTCDateTime),  # a sender is at work; another waits for it or its timeout
)

# Read models of the log, kept by consumers whose position moves in the same
# transaction as their writes (exactly once). Days are UTC.
usage_daily = Table(
    "usage_daily",
    metadata,
    Column("account_id", BigInteger, primary_key=True),
    Column("api_key_id", BigInteger, primary_key=True),  # 0 when the request had none
    Column("model", String(NAME_CHARS_MAX), primary_key=True),
    Column("day", String(DAY_CHARS), primary_key=True),  # YYYY-MM-DD
    Column("requests", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("cost_nano_usd", BigInteger, nullable=False),
)

earnings_daily = Table(
    "earnings_daily",
    metadata,
    Column("owner_account_id", BigInteger, primary_key=True),
    Column("worker_id", BigInteger, primary_key=True),
    Column("model", String(NAME_CHARS_MAX), primary_key=True),
    Column("day", String(DAY_CHARS), primary_key=True),
    Column("requests", BigInteger, nullable=False),
    Column("earnings_nano_usd", BigInteger, nullable=False),
)

# Every settled request, one row each, for the account's activity: what its
# settlements charged (the rest charged after its hold closed added, a
# reversal subtracted), as its first settlement described it. event_seq is
# the last event that changed the row, so "rows after seq N" are the rows new
# or changed since N, and the newest are first by it.
generations = Table(
    "generations",
    metadata,
    Column("request_id", String(IDEMPOTENCY_KEY_CHARS_MAX), primary_key=True),
    Column("account_id", BigInteger, nullable=False),  # the customer's
    Column("api_key_id", BigInteger, nullable=False),  # 0 when none
    Column("model", String(NAME_CHARS_MAX), nullable=False),
    Column("worker_id", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("cost_nano_usd", BigInteger, nullable=False),
    Column("owner_nano_usd", BigInteger, nullable=False),
    Column("ttft_ms", BigInteger),  # null: not recorded (an answer that settled before its meta said it)
    Column("status", String(GENERATION_STATUS_CHARS_MAX), nullable=False),  # streamed, completed, cancelled
    Column("completed_at", UTCDateTime, nullable=False),  # its first settlement's time
    Column("event_seq", BigInteger, nullable=False),
    Index("ix_generations_account_seq", "account_id", "event_seq"),
)

# Every posting, by account and time, with what it was for: the per-account
# view the hot append tables deliberately do not index. Kept by the same
# consumer as the tables above, in the same transactions, so statements and
# exports built from them always agree with each other.
account_postings = Table(
    "account_postings",
    metadata,
    Column("account_id", BigInteger, primary_key=True),
    Column("event_seq", BigInteger, primary_key=True),
    Column("leg", Integer, primary_key=True, autoincrement=False),
    Column("recorded_at", UTCDateTime, nullable=False),
    Column("event_type", String(EVENT_TYPE_CHARS_MAX), nullable=False),
    Column("source_type", String(EVENT_TYPE_CHARS_MAX), nullable=False),  # the reversed event's type for a reversal, else event_type
    Column("amount_nano_usd", BigInteger, nullable=False),
    Column("model", String(NAME_CHARS_MAX), nullable=False),  # settlements; '' otherwise
    Column("api_key_id", BigInteger, nullable=False),  # 0 when none
    Column("worker_id", BigInteger, nullable=False),
    Column("reference", String(REFERENCE_CHARS_MAX), nullable=False),  # request id, payment reference or reason
    Index("ix_account_postings_time", "account_id", "recorded_at", "event_seq", "leg"),
)

# The postings of each account summed per UTC day and kind (source_type, as
# in account_postings), kept by the same consumer in the same transactions: an
# opening balance, or a period's sums, from a row per day instead of a read of
# every posting the account ever had.
postings_daily = Table(
    "postings_daily",
    metadata,
    Column("account_id", BigInteger, primary_key=True),
    Column("day", String(DAY_CHARS), primary_key=True),  # YYYY-MM-DD of recorded_at, UTC
    Column("source_type", String(EVENT_TYPE_CHARS_MAX), primary_key=True),
    Column("postings", BigInteger, nullable=False),
    Column("amount_nano_usd", BigInteger, nullable=False),
)

# Monthly statements of closed months, one per account and month.
statements = Table(
    "statements",
    metadata,
    Column("account_id", BigInteger, ForeignKey("accounts.id"), primary_key=True),
    Column("month", String(MONTH_CHARS), primary_key=True),  # YYYY-MM, UTC
    Column("kind", String(ACCOUNT_KIND_CHARS_MAX), nullable=False),  # customer, owner
    Column("opening_balance_nano_usd", BigInteger, nullable=False),
    Column("closing_balance_nano_usd", BigInteger, nullable=False),
    Column("through_seq", BigInteger, nullable=False),  # the last ledger event of the month
    Column("issued_at", UTCDateTime, nullable=False),
    Column("pdf_path", String(PDF_PATH_CHARS_MAX), nullable=False),
    Column("pdf_sha256", Sha256, nullable=False),
)
