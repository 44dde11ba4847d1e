"""What an owner sees of its workers, and customers' low-balance alerts.

`workers.prefix_cache_hits_tokens` and `prefix_cache_queries_tokens`: the
worker's own prefix-cache counters as the last healthy probe scraped them
(NULL when it does not report them), so every replica shows its owner the
same hit rate.

`accounts.low_balance_threshold_nano_usd` (NULL: no alert), and the marks of
the alert run: `low_balance_alerted_at` (alerted since the balance last went
below; cleared once it is back at or above) and `low_balance_alert_claimed_at`
(a sender is at work, so two runs never send the same alert).

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import LOW_BALANCE_THRESHOLD_CHECK, UTCDateTime

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("prefix_cache_hits_tokens", sa.BigInteger))
    op.add_column("workers", sa.Column("prefix_cache_queries_tokens", sa.BigInteger))
    # A column constraint, added in place on SQLite too (no copy of the table).
    op.add_column("accounts", sa.Column("low_balance_threshold_nano_usd", sa.BigInteger,
                                        sa.CheckConstraint(LOW_BALANCE_THRESHOLD_CHECK, name="ck_accounts_low_balance_threshold")))
    op.add_column("accounts", sa.Column("low_balance_alerted_at", UTCDateTime))
    op.add_column("accounts", sa.Column("low_balance_alert_claimed_at", UTCDateTime))


def downgrade() -> None:
    with op.batch_alter_table("accounts") as batch:
        batch.drop_constraint("ck_accounts_low_balance_threshold", type_="check")
        batch.drop_column("low_balance_alert_claimed_at")
        batch.drop_column("low_balance_alerted_at")
        batch.drop_column("low_balance_threshold_nano_usd")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("prefix_cache_queries_tokens")
        batch.drop_column("prefix_cache_hits_tokens")
