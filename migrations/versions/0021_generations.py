"""Every request of an account, for its activity: `generations`, one row per
settled request, kept by the read models' consumer from the log, and
`unbilled_generations`, the requests that ended with nothing charged, which
the proxy writes (they are no ledger events).

The consumer starts again from the first event, so that `generations` holds
every request settled before this migration too: its tables are emptied and
its position forgotten here, and its next run rebuilds them all together.

Revision ID: 0021
Revises: 0019
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

CONSUMER = "read_models.usage_earnings"


def upgrade() -> None:
    op.create_table(
        "generations",
        sa.Column("request_id", sa.String(200), primary_key=True),
        sa.Column("account_id", sa.BigInteger, nullable=False),
        sa.Column("api_key_id", sa.BigInteger, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("worker_id", sa.BigInteger, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False),
        sa.Column("cost_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("owner_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("ttft_ms", sa.BigInteger),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("completed_at", UTCDateTime, nullable=False),
        sa.Column("event_seq", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_generations_account_seq", "generations", ["account_id", "event_seq"])
    op.create_table(
        "unbilled_generations",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(200), nullable=False, unique=True),
        sa.Column("account_id", sa.BigInteger, nullable=False),
        sa.Column("api_key_id", sa.BigInteger, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("worker_id", sa.BigInteger),
        sa.Column("stream", sa.Boolean, nullable=False),
        sa.Column("ttft_ms", sa.BigInteger),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("completed_at", UTCDateTime, nullable=False),
        sa.CheckConstraint("status IN ('failed', 'cancelled')", name="ck_unbilled_generations_status"),
    )
    op.create_index("ix_unbilled_generations_account", "unbilled_generations", ["account_id", "id"])
    # The position row first: its lock waits for a page being applied, so the deletes below see that page too.
    op.execute(f"DELETE FROM consumer_positions WHERE consumer = '{CONSUMER}'")
    op.execute("DELETE FROM usage_daily")
    op.execute("DELETE FROM earnings_daily")
    op.execute("DELETE FROM account_postings")


def downgrade() -> None:
    op.drop_index("ix_unbilled_generations_account", "unbilled_generations")
    op.drop_table("unbilled_generations")
    op.drop_index("ix_generations_account_seq", "generations")
    op.drop_table("generations")
