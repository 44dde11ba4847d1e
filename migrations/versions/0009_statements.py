"""Postings by account and time (for statements and exports) and monthly statements.

The new table is kept by the existing usage and earnings consumer, so that
consumer starts again from the first event: its tables are emptied and its
position forgotten here, and its next run rebuilds all three together.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

CONSUMER = "read_models.usage_earnings"


def upgrade() -> None:
    op.create_table(
        "account_postings",
        sa.Column("account_id", sa.BigInteger, primary_key=True),
        sa.Column("event_seq", sa.BigInteger, primary_key=True),
        sa.Column("leg", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("recorded_at", UTCDateTime, nullable=False),
        sa.Column("event_type", sa.String(64), nullable=False),
        sa.Column("source_type", sa.String(64), nullable=False),
        sa.Column("amount_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("api_key_id", sa.BigInteger, nullable=False),
        sa.Column("worker_id", sa.BigInteger, nullable=False),
        sa.Column("reference", sa.String(500), nullable=False),
    )
    op.create_index("ix_account_postings_time", "account_postings", ["account_id", "recorded_at", "event_seq", "leg"])
    op.create_table(
        "statements",
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("month", sa.String(7), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("opening_balance_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("closing_balance_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("through_seq", sa.BigInteger, nullable=False),
        sa.Column("issued_at", UTCDateTime, nullable=False),
        sa.Column("pdf_path", sa.String(1000), nullable=False),
        sa.Column("pdf_sha256", sa.LargeBinary(32), nullable=False),
    )
    # The position row first: its lock waits for a page being applied, so the deletes below see that page too.
    op.execute(f"DELETE FROM consumer_positions WHERE consumer = '{CONSUMER}'")
    op.execute("DELETE FROM usage_daily")
    op.execute("DELETE FROM earnings_daily")


def downgrade() -> None:
    op.drop_table("statements")
    op.drop_index("ix_account_postings_time", "account_postings")
    op.drop_table("account_postings")
