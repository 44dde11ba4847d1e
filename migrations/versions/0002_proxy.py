"""The proxy: API keys, model prices, workers.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import BigId, UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("key_sha256", sa.LargeBinary(32), nullable=False, unique=True),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        sa.Column("name", sa.String(200)),
        sa.Column("spend_limit_nano_usd", sa.BigInteger),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("revoked_at", UTCDateTime),
        sa.CheckConstraint("spend_limit_nano_usd IS NULL OR spend_limit_nano_usd > 0", name="ck_api_keys_limit_positive"),
    )
    op.create_index("ix_api_keys_account", "api_keys", ["account_id"])
    op.create_table(
        "api_key_spend",
        sa.Column("key_id", sa.BigInteger, sa.ForeignKey("api_keys.id"), primary_key=True),
        sa.Column("spent_nano_usd", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    )
    op.create_table(
        "model_prices",
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("input_nano_usd_per_token", sa.BigInteger, nullable=False),
        sa.Column("output_nano_usd_per_token", sa.BigInteger, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
        sa.CheckConstraint("input_nano_usd_per_token >= 0 AND output_nano_usd_per_token > 0", name="ck_model_prices_positive"),
    )
    op.create_table(
        "workers",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("owner_account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("url", sa.String(2000), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("engine", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, server_default=sa.text("'active'")),
        sa.Column("context_length", sa.Integer),
        sa.Column("served_model", sa.String(200)),
        sa.Column("healthy", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("last_heartbeat_at", UTCDateTime),
        sa.Column("drain_requested_at", UTCDateTime),
        sa.Column("drained_at", UTCDateTime),
        sa.Column("usage_strikes", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("throughput_tokens_per_s", sa.Integer),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.CheckConstraint("engine IN ('vllm', 'llamacpp')", name="ck_workers_engine"),
        sa.CheckConstraint("state IN ('active', 'draining', 'drained', 'suspended')", name="ck_workers_state"),
    )
    op.create_index("ix_workers_model", "workers", ["model"])


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("model_prices")
    op.drop_table("api_key_spend")
    op.drop_index("ix_api_keys_account", "api_keys")
    op.drop_table("api_keys")
