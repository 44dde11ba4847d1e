"""A hold may be taken down to zero.

A pooled hold (`ledger.hold_pool`, PARALON_HOLD_POOLS) loses what its
requests capture (captures that are not final) and what moves to holds of
their own: the last of them can take all it has left. The hold then stays,
holding nothing, until its replica releases it, as any hold in use would;
placing a hold still asks for a positive amount.

Revision ID: 0038
Revises: 0037
Create Date: 2026-12-05
"""
from alembic import op

revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("holds") as batch:
        batch.drop_constraint("ck_holds_amount_positive", type_="check")
        batch.create_check_constraint("ck_holds_amount_not_negative", "amount_nano_usd >= 0")


def downgrade() -> None:
    # A hold of zero reserves nothing: deleting it leaves every held sum as it was.
    op.execute("DELETE FROM holds WHERE amount_nano_usd = 0")
    with op.batch_alter_table("holds") as batch:
        batch.drop_constraint("ck_holds_amount_not_negative", type_="check")
        batch.create_check_constraint("ck_holds_amount_positive", "amount_nano_usd > 0")
