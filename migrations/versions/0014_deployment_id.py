"""The deployment's own id: a random UUID made once per database, part of
where its documents are stored, so two deployments sharing one
PARALON_INVOICE_DIR never find each other's files under their own names.

A database restored from a backup keeps the id of the one it was taken from:
document file names also carry the PDF's SHA-256, so a number issued again
after a restore gets a name of its own too.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30
"""
import uuid

import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime, utc_now

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "deployment",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("deployment_id", sa.String(36), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.CheckConstraint("id = 1", name="ck_deployment_one_row"),
    )
    op.bulk_insert(table, [{"id": 1, "deployment_id": str(uuid.uuid4()), "created_at": utc_now()}])


def downgrade() -> None:
    op.drop_table("deployment")
