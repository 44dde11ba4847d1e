"""Invoices and credit notes.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "invoice_counters",
        sa.Column("series", sa.String(16), primary_key=True),
        sa.Column("year", sa.Integer, primary_key=True),
        sa.Column("last_number", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "invoices",
        sa.Column("number", sa.String(32), primary_key=True),
        sa.Column("series", sa.String(16), nullable=False),
        sa.Column("year", sa.Integer, nullable=False),
        sa.Column("sequence", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("source_seq", sa.BigInteger, nullable=False, unique=True),
        sa.Column("corrects_number", sa.String(32)),
        sa.Column("amount_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("payment_method", sa.String(16), nullable=False),
        sa.Column("external_reference", sa.String(500), nullable=False),
        sa.Column("issued_at", UTCDateTime, nullable=False),
        sa.Column("pdf_path", sa.String(1000)),
        sa.Column("pdf_sha256", sa.LargeBinary(32)),
        sa.Column("issued_event_seq", sa.BigInteger),
        sa.Column("emailed_at", UTCDateTime),
        sa.Column("email_claimed_at", UTCDateTime),
        sa.UniqueConstraint("series", "year", "sequence", name="uq_invoices_series_year_sequence"),
        sa.CheckConstraint("kind IN ('invoice', 'credit_note')", name="ck_invoices_kind"),
    )
    op.create_index("ix_invoices_account", "invoices", ["account_id", "issued_at"])
    # Tasks to enqueue once the transaction that made them necessary commits.
    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("task", sa.String(100), nullable=False),
        sa.Column("args", sa.Text, nullable=False),  # JSON list
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("dispatched_at", UTCDateTime),
    )


def downgrade() -> None:
    op.drop_table("outbox")
    op.drop_table("invoices")
    op.drop_table("invoice_counters")
