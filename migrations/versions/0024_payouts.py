"""Owners' payouts: destinations per rail, payouts and their states, the USDC
rail's signed transactions and hot-wallet nonces, receipts; and, per rail, the
platform's payouts-in-flight account (never below zero) and the external
account of what left through it.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-01
"""
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

from ledger.schema import BigId, UTCDateTime

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

RAILS = {"usdc": "USDC", "stripe": "Stripe Connect"}
IN_FLIGHT = "platform:payouts_in_flight:{rail}"
PAID = "external:payouts:{rail}"
IN_FLIGHT_STATES = "state IN ('requested', 'sent')"


def upgrade() -> None:
    op.create_table(
        "payout_destinations",
        sa.Column("owner_account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("rail", sa.String(16), primary_key=True),
        sa.Column("destination", sa.String(255), nullable=False),
        sa.Column("previous_destination", sa.String(255)),
        sa.Column("changed_at", UTCDateTime, nullable=False),
        sa.Column("usable_from", UTCDateTime, nullable=False),
        sa.Column("weekly", sa.Boolean, nullable=False, server_default=sa.text("false")),
    )
    op.create_table(
        "payouts",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("owner_account_id", sa.BigInteger, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("rail", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("amount_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("fee_nano_usd", sa.BigInteger, nullable=False),
        sa.Column("destination", sa.String(255), nullable=False),
        sa.Column("requested_at", UTCDateTime, nullable=False),
        sa.Column("requested_seq", sa.BigInteger),
        sa.Column("reference", sa.String(255)),
        sa.Column("raw_amount", sa.Numeric(78, 0)),
        sa.Column("sent_at", UTCDateTime),
        sa.Column("block_number", sa.BigInteger),
        sa.Column("confirmations", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("closed_at", UTCDateTime),
        sa.Column("closed_seq", sa.BigInteger),
        sa.Column("failure_reason", sa.String(500)),
    )
    op.create_index("ux_payouts_in_flight", "payouts", ["owner_account_id", "rail"], unique=True,
                    postgresql_where=sa.text(IN_FLIGHT_STATES), sqlite_where=sa.text(IN_FLIGHT_STATES))
    op.create_index("ix_payouts_owner", "payouts", ["owner_account_id", "id"])
    op.create_table(
        "payout_transactions",
        sa.Column("tx_hash", sa.String(66), primary_key=True),
        sa.Column("payout_id", sa.BigInteger, sa.ForeignKey("payouts.id"), nullable=False),
        sa.Column("chain_id", sa.BigInteger, nullable=False),
        sa.Column("nonce", sa.BigInteger, nullable=False),
        sa.Column("max_fee_per_gas_wei", sa.Numeric(78, 0), nullable=False),
        sa.Column("raw_transaction", sa.LargeBinary, nullable=False),
        sa.Column("signed_at", UTCDateTime, nullable=False),
        sa.Column("broadcast_at", UTCDateTime),
    )
    op.create_index("ix_payout_transactions_payout_id", "payout_transactions", ["payout_id"])
    op.create_table(
        "payout_wallets",
        sa.Column("chain_id", sa.BigInteger, primary_key=True),
        sa.Column("address", sa.String(42), primary_key=True),
        sa.Column("next_nonce", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "payout_receipts",
        sa.Column("payout_id", sa.BigInteger, sa.ForeignKey("payouts.id"), primary_key=True),
        sa.Column("pdf_path", sa.Text, nullable=False),
        sa.Column("pdf_sha256", sa.LargeBinary(32), nullable=False),
    )
    _add_system_accounts()


def _add_system_accounts() -> None:
    accounts = sa.table("accounts", sa.column("id", sa.BigInteger), sa.column("kind", sa.String), sa.column("name", sa.String),
                        sa.column("system_code", sa.String), sa.column("created_at", UTCDateTime))
    balances = sa.table("account_balances", sa.column("account_id", sa.BigInteger))
    bind = op.get_bind()
    existing = set(bind.execute(sa.select(accounts.c.system_code).where(accounts.c.system_code.is_not(None))).scalars())
    for rail, name in RAILS.items():
        for code, kind, title in ((IN_FLIGHT.format(rail=rail), "platform", f"Payouts in flight ({name})"),
                                  (PAID.format(rail=rail), "external", f"Payouts paid ({name})")):
            if code in existing:  # kept by a downgrade (accounts are never deleted): upgraded again
                continue
            account_id = bind.execute(accounts.insert().values(kind=kind, name=title, system_code=code, created_at=datetime.now(UTC))
                                      .returning(accounts.c.id)).scalar_one()
            bind.execute(balances.insert().values(account_id=account_id))


def downgrade() -> None:
    """The tables go; the accounts stay (an account with postings is never deleted) and are reused by an upgrade."""
    for table in ("payout_receipts", "payout_wallets", "payout_transactions", "payouts", "payout_destinations"):
        op.drop_table(table)
