"""The postings guard reads the statement's events by index, whatever size
the log had when its plan was made.

A trigger function's statements keep their plans for the life of a
connection. The guard's range read of ledger_events (0026) was planned, on a
connection that appended while the log was nearly empty, as a sequential scan
of the whole log, kept as the log grew: every batch of that writer then read
every event ever appended (7,589 rows for a batch of 25, measured with
`auto_explain` after 300 batches). Now the range's two ends are read first,
into variables, and the events between them by the sequence's index: with
sequential scans off for the function, as 0028 does for the hold function,
any plan of it is that index range scan.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-01
"""
from alembic import op

from app.migrate import earlier_revision

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

GUARD = "paralon_guard_postings()"

# 0026's function, with its range read from two variables set just before.
_DECLARED = "    bad record;\n"
_RANGE_READ = """      LEFT JOIN (SELECT e.seq, e.xmin
                   FROM (SELECT min(event_seq) AS lo, max(event_seq) AS hi FROM new_postings) r
                   JOIN ledger_events e ON e.seq BETWEEN r.lo AND r.hi) e ON e.seq = n.event_seq
"""
_FIRST_CHECK = "    SELECT n.event_seq, 'it names no event this transaction inserted' AS why INTO bad\n"


def _guard_of_0026() -> str:
    return earlier_revision("0026_postings_guard_per_statement.py").GUARD_POSTINGS


def guard_reading_by_index() -> str:
    guard = _guard_of_0026()
    for part in (_DECLARED, _RANGE_READ, _FIRST_CHECK):
        if guard.count(part) != 1:
            raise RuntimeError("0026's postings guard is not what this revision expects")
    return (guard.replace(_DECLARED, _DECLARED + "    lo bigint;\n    hi bigint;\n", 1)
            .replace(_FIRST_CHECK, "    SELECT min(event_seq), max(event_seq) INTO lo, hi FROM new_postings;\n" + _FIRST_CHECK, 1)
            .replace(_RANGE_READ, "      LEFT JOIN (SELECT e.seq, e.xmin FROM ledger_events e WHERE e.seq BETWEEN lo AND hi) e"
                                  " ON e.seq = n.event_seq\n", 1))


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(guard_reading_by_index())
        op.execute(f"ALTER FUNCTION {GUARD} SET enable_seqscan = off")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_guard_of_0026())
        op.execute(f"ALTER FUNCTION {GUARD} RESET enable_seqscan")
