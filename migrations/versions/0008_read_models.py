"""Read models: usage per account, key, model and day; earnings per owner, worker, model and day.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_daily",
        sa.Column("account_id", sa.BigInteger, primary_key=True),
        sa.Column("api_key_id", sa.BigInteger, primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False),
        sa.Column("cost_nano_usd", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "earnings_daily",
        sa.Column("owner_account_id", sa.BigInteger, primary_key=True),
        sa.Column("worker_id", sa.BigInteger, primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("earnings_nano_usd", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("earnings_daily")
    op.drop_table("usage_daily")
