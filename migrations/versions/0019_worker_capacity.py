"""A worker's measured capacity, agreed by every proxy replica.

`throughput_tokens_per_s` keeps its name and now holds the output tokens per
second the worker delivered, from its own counters (proxy/capacity.py):
`capacity_saturated` says it was measured while the worker queued requests
(its capacity, not only a floor), `capacity_requests` is the batch it ran
then, and `capacity_measured_at` lets one replica per period write it.
`relayed_tokens_total` is what every replica relayed from the worker, added
at each health check: a worker's own counter is believed only up to a
margin above it. `long_prompts_until`: the worker alone held a recent long
prompt, and every replica keeps room on it for such prompts until then.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("capacity_saturated", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("workers", sa.Column("capacity_requests", sa.Integer))
    op.add_column("workers", sa.Column("capacity_measured_at", UTCDateTime))
    op.add_column("workers", sa.Column("relayed_tokens_total", sa.BigInteger, nullable=False, server_default=sa.text("0")))
    op.add_column("workers", sa.Column("long_prompts_until", UTCDateTime))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("long_prompts_until")
        batch.drop_column("relayed_tokens_total")
        batch.drop_column("capacity_measured_at")
        batch.drop_column("capacity_requests")
        batch.drop_column("capacity_saturated")
