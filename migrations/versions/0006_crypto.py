"""Stablecoin deposits: addresses, scan positions, recent block hashes, transfers.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "crypto_deposit_addresses",
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("address", sa.String(42), nullable=False, unique=True),
        sa.Column("derivation_index", sa.BigInteger, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    op.create_table(
        "crypto_scan_positions",
        sa.Column("chain_id", sa.BigInteger, primary_key=True),
        sa.Column("next_block", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "crypto_blocks",
        sa.Column("chain_id", sa.BigInteger, primary_key=True),
        sa.Column("number", sa.BigInteger, primary_key=True),
        sa.Column("hash", sa.String(66), nullable=False),
    )
    op.create_table(
        "crypto_transfers",
        sa.Column("chain_id", sa.BigInteger, primary_key=True),
        sa.Column("tx_hash", sa.String(66), primary_key=True),
        sa.Column("log_index", sa.BigInteger, primary_key=True),
        sa.Column("block_number", sa.BigInteger, nullable=False),
        sa.Column("block_hash", sa.String(66), nullable=False),
        sa.Column("token", sa.String(42), nullable=False),
        sa.Column("to_address", sa.String(42), nullable=False),
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("raw_amount", sa.Numeric(78, 0), nullable=False),
        sa.Column("amount_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("credit_seq", sa.BigInteger),
    )


def downgrade() -> None:
    for table in ("crypto_transfers", "crypto_blocks", "crypto_scan_positions", "crypto_deposit_addresses"):
        op.drop_table(table)
