"""Management tokens with roles.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import BigId, UTCDateTime

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "management_tokens",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("token_sha256", sa.LargeBinary(32), nullable=False, unique=True),
        sa.Column("token_prefix", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("revoked_at", UTCDateTime),
        sa.CheckConstraint("role IN ('customer', 'accountant', 'owner', 'admin')", name="ck_management_tokens_role"),
    )


def downgrade() -> None:
    op.drop_table("management_tokens")
