"""Stripe events that cannot be processed are parked: how many attempts were
made, when the next one is due (none after the last), and why it failed.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("stripe_events") as batch:
        batch.add_column(sa.Column("attempts", sa.BigInteger, nullable=False, server_default=sa.text("0")))
        batch.add_column(sa.Column("parked_at", UTCDateTime))
        batch.add_column(sa.Column("next_attempt_at", UTCDateTime))
        batch.add_column(sa.Column("last_error", sa.String(500)))


def downgrade() -> None:
    with op.batch_alter_table("stripe_events") as batch:
        for name in ("last_error", "next_attempt_at", "parked_at", "attempts"):
            batch.drop_column(name)
