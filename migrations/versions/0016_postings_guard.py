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

# Both queries go from the statement's events to the indexes (LATERAL, so
# each is a primary-key lookup, not a scan of a table that only grows).
# xid is 32 bits and wraps; txid_current() is the 64-bit id (epoch in the high
# bits). An event's xmin is made 64-bit the way the server compares xids: as
# the id within 2^31 before or after the current one (a subtransaction's id
# comes after its transaction's; an old event's before). The postings of one
# event are inserted by one statement (the append's), so each statement's
# events must already sum to zero.
GUARD_POSTINGS = """
CREATE FUNCTION paralon_guard_postings() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    current_full bigint := txid_current();
    current_low bigint := current_full % 4294967296;
    bad record;
BEGIN
    SELECT n.event_seq, 'it names no event this transaction inserted' AS why INTO bad
      FROM (SELECT DISTINCT event_seq FROM new_postings) n
      LEFT JOIN LATERAL (SELECT e.xmin FROM ledger_events e WHERE e.seq = n.event_seq LIMIT 1) e ON true
     WHERE e.xmin IS NULL
        OR (NOT e.xmin = current_low::text::xid
            AND pg_xact_status(greatest(current_full
                + ((e.xmin::text::bigint - current_low + 6442450944) % 4294967296) - 2147483648, 0)::text::xid8)
                IS DISTINCT FROM 'in progress')
     LIMIT 1;
    IF NOT FOUND THEN
        SELECT n.event_seq, 'its postings sum to ' || s.total || ' nano-USD, not 0' AS why INTO bad
          FROM (SELECT DISTINCT event_seq FROM new_postings) n
          CROSS JOIN LATERAL (SELECT sum(p.amount_nano_usd) AS total FROM ledger_postings p
                               WHERE p.event_seq = n.event_seq) s
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
