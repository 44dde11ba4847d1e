"""What the USDC sender last found in its hot wallet, for /metrics: the payout
token's balance in its smallest unit, the gas balance in wei (both decimal
text, exact on SQLite too) and how many payouts wait for funds.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

UINT256_DIGITS = 78


def upgrade() -> None:
    op.add_column("payout_wallets", sa.Column("token_balance_raw", sa.String(UINT256_DIGITS)))
    op.add_column("payout_wallets", sa.Column("gas_balance_wei", sa.String(UINT256_DIGITS)))
    op.add_column("payout_wallets", sa.Column("payouts_waiting_for_funds", sa.BigInteger, nullable=False,
                                              server_default=sa.text("0")))
    op.add_column("payout_wallets", sa.Column("balances_at", UTCDateTime))


def downgrade() -> None:
    with op.batch_alter_table("payout_wallets") as batch:
        for column in ("balances_at", "payouts_waiting_for_funds", "gas_balance_wei", "token_balance_raw"):
            batch.drop_column(column)
