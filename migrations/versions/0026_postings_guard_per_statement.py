"""The postings guard (0016) checks each statement's own postings, in two set-based passes.

The same two rules, cheaper under the append lock, where every batch runs it:
- every posting names an event this transaction inserted: the statement's
  events are read with one range scan of ledger_events (its lowest to its
  highest event), not one index probe per event;
- each event's postings in the statement sum to zero: summed from the
  transition table alone, not read back from ledger_postings. That is the
  same rule as "all of the event's postings sum to zero": postings are never
  updated or deleted, an event's postings can only be inserted in the
  transaction that inserted the event (the first rule), and sums that are zero
  in every statement are zero in all of them.

Measured by benchmarks/append_statement.py: the guard's share of a batch's
write statement fell from about 18% to about 10% (3.5 to 4.3 µs per settlement
before, 2.0 to 2.5 after, alternating the two on the same server).

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-01
"""
from alembic import op

from app.migrate import earlier_revision

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

# An event's xmin is made 64-bit as in 0016: the id within 2^31 before or after
# the current one (a subtransaction's id comes after its transaction's).
GUARD_POSTINGS = """
CREATE OR REPLACE FUNCTION paralon_guard_postings() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    current_full bigint := txid_current();
    current_low bigint := current_full % 4294967296;
    bad record;
BEGIN
    SELECT n.event_seq, 'it names no event this transaction inserted' AS why INTO bad
      FROM (SELECT DISTINCT event_seq FROM new_postings) n
      LEFT JOIN (SELECT e.seq, e.xmin
                   FROM (SELECT min(event_seq) AS lo, max(event_seq) AS hi FROM new_postings) r
                   JOIN ledger_events e ON e.seq BETWEEN r.lo AND r.hi) e ON e.seq = n.event_seq
     WHERE e.xmin IS NULL
        OR (NOT e.xmin = current_low::text::xid
            AND pg_xact_status(greatest(current_full
                + ((e.xmin::text::bigint - current_low + 6442450944) % 4294967296) - 2147483648, 0)::text::xid8)
                IS DISTINCT FROM 'in progress')
     LIMIT 1;
    IF NOT FOUND THEN
        SELECT s.event_seq, 'its postings sum to ' || s.total || ' nano-USD, not 0' AS why INTO bad
          FROM (SELECT event_seq, sum(amount_nano_usd) AS total FROM new_postings GROUP BY event_seq) s
         WHERE s.total <> 0
         LIMIT 1;
    END IF;
    IF FOUND THEN
        RAISE EXCEPTION 'ledger_postings: a posting of event % refused: %', bad.event_seq, bad.why
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END $$
"""


def _guard_of_0016() -> str:
    return earlier_revision("0016_postings_guard.py").GUARD_POSTINGS.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(GUARD_POSTINGS)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_guard_of_0016())
