"""Card top-ups through Stripe: the clearing account, the sessions this
service created, and every webhook event received (unique on its id).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    bind = op.get_bind()
    accounts = sa.table("accounts", sa.column("id"), sa.column("kind"), sa.column("name"), sa.column("system_code"),
                        sa.column("created_at", UTCDateTime))
    for code, name in (("external:stripe", "Stripe clearing"), ("external:stripe:disputed", "Disputed card payments")):
        account_id = bind.execute(
            accounts.insert().values(kind="external", name=name, system_code=code, created_at=datetime.now(UTC)).returning(accounts.c.id)
        ).scalar_one()
        bind.execute(sa.table("account_balances", sa.column("account_id")).insert().values(account_id=account_id))
    op.create_table(
        "stripe_checkout_sessions",
        sa.Column("session_id", sa.String(255), primary_key=True),
        sa.Column("account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("amount_cents", sa.BigInteger, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("payment_intent", sa.String(255), unique=True),
        sa.Column("credited_cents", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("credit_seq", sa.BigInteger),
        sa.Column("refunded_cents", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    )
    op.create_table(
        "stripe_disputes",
        sa.Column("dispute_id", sa.String(255), primary_key=True),
        sa.Column("session_id", sa.String(255), sa.ForeignKey("stripe_checkout_sessions.session_id"), nullable=False),
        sa.Column("amount_cents", sa.BigInteger, nullable=False),
        sa.Column("freeze_seq", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),  # frozen, won, lost
    )
    op.create_table(
        "stripe_events",
        sa.Column("event_id", sa.String(255), primary_key=True),
        sa.Column("event_type", sa.String(100), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),  # the raw body, as signed
        sa.Column("received_at", UTCDateTime, nullable=False),
        sa.Column("processed_at", UTCDateTime),
        sa.Column("outcome", sa.String(500)),
    )


def downgrade() -> None:
    op.drop_table("stripe_events")
    op.drop_table("stripe_disputes")
    op.drop_table("stripe_checkout_sessions")
