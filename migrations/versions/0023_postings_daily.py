"""The postings of each account summed per UTC day and kind: `postings_daily`,
kept by the read models' consumer beside `account_postings`, so that an
opening balance (a statement's, a reconciliation's, an export's) reads a row
per day instead of every posting the account ever had.

Filled here from `account_postings` as it stands, in the same transaction,
after taking the consumer's position row: a page being applied finishes
first, and the next waits for this commit (then writes both).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

CONSUMER = "read_models.usage_earnings"


def upgrade() -> None:
    op.create_table(
        "postings_daily",
        sa.Column("account_id", sa.BigInteger, primary_key=True),
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("source_type", sa.String(64), primary_key=True),
        sa.Column("postings", sa.BigInteger, nullable=False),
        sa.Column("amount_nano_usd", sa.BigInteger, nullable=False),
    )
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        op.execute(f"SELECT last_seq FROM consumer_positions WHERE consumer = '{CONSUMER}' FOR UPDATE")
    # SQLite keeps a UTC time as 'YYYY-MM-DD HH:MM:SS.ffffff'.
    day = "to_char(recorded_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')" if postgres else "substr(recorded_at, 1, 10)"
    op.execute(f"INSERT INTO postings_daily (account_id, day, source_type, postings, amount_nano_usd) "
               f"SELECT account_id, {day}, source_type, count(*), sum(amount_nano_usd) FROM account_postings "
               f"GROUP BY account_id, {day}, source_type")


def downgrade() -> None:
    op.drop_table("postings_daily")
