"""Stored responses: each response's items, per account, for `previous_response_id`.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("response_id", sa.String(200), primary_key=True),
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("input_items", sa.Text, nullable=False),
        sa.Column("output_items", sa.Text, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("stored_responses")
