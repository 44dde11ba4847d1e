"""Postings only beside their own event, and each event's postings sum to zero.

PostgreSQL: `ledger_postings_guard`, after every INSERT statement on
ledger_postings (a transition table, so one set-based query per statement,
seeing the events a data-modifying CTE inserted beside the postings), refuses
the statement unless every new posting names an event this transaction
inserted, and the postings of each such event sum to zero. Without it, the
service's role (which may insert postings, as appends do) could attach a
posting to an old event, then move a balance over that event's range past the
balance guard (0013); only a full `ledger verify` would find it.

"This transaction inserted the event": the event row's xmin is the
transaction's id, or one of its subtransactions' (a visible row whose xmin is
still in progress can only be the reader's own: other transactions' uncommitted
rows are invisible). xmin is written by the server, so no role can forge it.
The owner role owns the trigger; the service's role cannot disable it.

SQLite has no roles: whoever can write the file can change anything, and
`ledger verify` is what finds it.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-30
"""
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# xid is 32 bits and wraps; txid_current() is the 64-bit id (epoch in the high
# bits). An event's xmin is made 64-bit in the current epoch, or the previous
# one when it is above the current id's low bits.
GUARD_POSTINGS = """
CREATE FUNCTION paralon_guard_postings() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    current_full bigint := txid_current();
    current_low bigint := current_full % 4294967296;
    bad record;
BEGIN
    SELECT n.event_seq, 'it names no event this transaction inserted' AS why INTO bad
      FROM (SELECT DISTINCT event_seq FROM new_postings) n
      LEFT JOIN ledger_events e ON e.seq = n.event_seq
     WHERE e.seq IS NULL
        OR (NOT e.xmin = current_low::text::xid
            AND pg_xact_status((current_full - current_low + e.xmin::text::bigint
                - CASE WHEN e.xmin::text::bigint > current_low THEN 4294967296 ELSE 0 END)::text::xid8)
                IS DISTINCT FROM 'in progress')
     LIMIT 1;
    IF NOT FOUND THEN
        SELECT p.event_seq, 'its postings sum to ' || sum(p.amount_nano_usd) || ' nano-USD, not 0' AS why INTO bad
          FROM ledger_postings p
         WHERE p.event_seq IN (SELECT DISTINCT event_seq FROM new_postings)
         GROUP BY p.event_seq HAVING sum(p.amount_nano_usd) <> 0
         LIMIT 1;
    END IF;
    IF FOUND THEN
        RAISE EXCEPTION 'ledger_postings: a posting of event % refused: %', bad.event_seq, bad.why
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END $$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(GUARD_POSTINGS)
    op.execute("CREATE TRIGGER ledger_postings_guard AFTER INSERT ON ledger_postings "
               "REFERENCING NEW TABLE AS new_postings "
               "FOR EACH STATEMENT EXECUTE FUNCTION paralon_guard_postings()")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER ledger_postings_guard ON ledger_postings")
        op.execute("DROP FUNCTION paralon_guard_postings()")
