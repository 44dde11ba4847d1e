"""Suspensions with their reason and time, and the evidence strikes are decided on.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("suspended_at", UTCDateTime))
    op.add_column("workers", sa.Column("suspension_reason", sa.String(500)))
    op.create_table(
        "usage_evidence",
        sa.Column("request_id", sa.String(200), primary_key=True),
        sa.Column("worker_id", sa.BigInteger, sa.ForeignKey("workers.id"), nullable=False),
        sa.Column("customer_account_id", sa.BigInteger, nullable=False),
        sa.Column("reason", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("recorded_at", UTCDateTime, nullable=False),
        sa.Column("ledger_seq", sa.BigInteger, nullable=False),
        sa.CheckConstraint("state IN ('pending', 'struck', 'cleared')", name="ck_usage_evidence_state"),
    )
    op.create_index("ix_usage_evidence_worker", "usage_evidence", ["worker_id", "state", "reason", "recorded_at"])
    # A worker suspended before this revision gets a reason an operator can read.
    op.execute("UPDATE workers SET suspension_reason = 'usage strikes (before suspensions were recorded)' "
               "WHERE state = 'suspended'")


def downgrade() -> None:
    op.drop_index("ix_usage_evidence_worker", "usage_evidence")
    op.drop_table("usage_evidence")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("suspension_reason")
        batch.drop_column("suspended_at")
