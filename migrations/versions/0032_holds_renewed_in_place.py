"""Holds lose their index by expiry, and keep room on their pages, so that a
renewal rewrites a hold in place.

A running request renews its hold about once a second (its expiry pushed
back, its capture recorded): on a long stream, many more writes than the one
that placed it. With `expires_at` indexed, every renewal wrote a new row
version and an entry in each of the three indexes; without that index, and
with a third of each page left free, PostgreSQL updates the row on its own
page and touches no index (a heap-only update). Placing a hold writes one
index entry fewer. Measured (`benchmarks/holds_writes.py`, three runs): a
renewal takes 0.72 to 0.77 of the server's time and 0.57 of the WAL, a
placement 0.84 to 0.94 of the time and 0.81 of the WAL.

The sweeper, the only reader by expiry, scans the holds instead: the table
holds only what is in flight (a closed hold is deleted), a few rows per
running request.

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-02
"""
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None

HOLDS_FILLFACTOR_PERCENT = 70


def upgrade() -> None:
    op.drop_index("ix_holds_expiry", "holds")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE holds SET (fillfactor = {HOLDS_FILLFACTOR_PERCENT})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE holds RESET (fillfactor)")
    op.create_index("ix_holds_expiry", "holds", ["expires_at"])
