"""The balance guard reads each customer's placed holds once per statement.

0030's guard checked that no customer closes more holds than were placed with
a subquery per changed row: `customer_holds` is a few pages, so its plan was a
sequential scan, run once for every customer whose closed holds moved (each
batch's statement after its rows moves them for every customer it settled,
under the append lock). Here `customer_holds` is joined once, a hash join
beside the one of the old and new rows. Measured with pg_stat_statements
(track = all) on batches of 256 settlements, two runs each, alternating: the
guard's statement took 3.47 and 3.79 µs a settlement before, 0.92 and 0.96
after; the statement after the rows that fires it, 9.30 and 9.84 µs before,
6.16 and 6.23 after.

The rules, the message and the function's settings are 0030's.

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-03
"""
from alembic import op

from app.migrate import earlier_revision

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None

BALANCE_GUARD = "paralon_guard_balances()"
_OLD_ROWS_JOINED = "      FROM new_rows n JOIN old_rows o ON o.account_id = n.account_id\n"
_PLACED_PER_ROW = """coalesce(
               (SELECT c.holds_placed_nano_usd FROM customer_holds c WHERE c.account_id = n.account_id), 0))"""


def _guard_of_0030() -> str:
    return earlier_revision("0030_balances_moved_by_their_postings.py").GUARD_BALANCES


def guard_reading_placed_once() -> str:
    original = _guard_of_0030()
    if any(original.count(part) != 1 for part in (_OLD_ROWS_JOINED, _PLACED_PER_ROW)):
        raise RuntimeError("0030's balance guard is not what this revision expects")
    return (original.replace(_OLD_ROWS_JOINED, _OLD_ROWS_JOINED + "      LEFT JOIN customer_holds c ON c.account_id = n.account_id\n", 1)
            .replace(_PLACED_PER_ROW, "coalesce(c.holds_placed_nano_usd, 0))", 1))


def _replace(function_text: str) -> None:
    op.execute(function_text)  # CREATE OR REPLACE resets what ALTER FUNCTION set: set again as 0030 did
    op.execute(f"ALTER FUNCTION {BALANCE_GUARD} SET enable_nestloop = off")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace(guard_reading_placed_once())


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace(_guard_of_0030())
