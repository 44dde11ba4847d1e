"""An event may carry its postings in its own row, as two arrays.

Each settlement writes one event row and three posting rows with their three
key entries; the three rows and their guard are the largest part of the time
an append holds the lock (README, "Postings in their event's row"). Here the
event row gains `posting_account_ids` and `posting_amounts_nano_usd`, legs in
order. This is the expand step: what reads postings reads them from both
places (the view `ledger_event_postings`), and a writer puts them in the
event row only once `ledger_head.postings_in_event_row` is set, which an
operator does (`paralon ledger postings-in-event-row on`) when every replica
runs a release that reads them there. Until then appends write rows as before.

On PostgreSQL the arrays are held to the rules the posting rows are held to:
- a CHECK: both arrays or neither, one dimension, the same length, at least
  one leg and no NULL in either (NOT VALID: every existing row has neither);
- a statement trigger on ledger_events, run as its owner as the postings
  guard is (0030), refuses an event whose legs do not sum to zero and moves
  each account's balance by the sum of its legs and its last_event_seq to the
  last of them, in the same statement; the balance guard (0030) accepts only
  such moves;
- the postings guard refuses posting rows for an event that carries its
  postings in its row, so an event's legs are in one place only.

SQLite keeps posting rows: its view is the rows alone, and nothing there
sets the flag.

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

from app.migrate import earlier_revision

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

APPLY = "paralon_apply_event_postings()"
GUARD = "paralon_guard_postings()"

ARRAYS_CHECK = """
    (posting_account_ids IS NULL) = (posting_amounts_nano_usd IS NULL)
    AND array_ndims(posting_account_ids) = 1 AND array_ndims(posting_amounts_nano_usd) = 1
    AND cardinality(posting_account_ids) = cardinality(posting_amounts_nano_usd)
    AND cardinality(posting_account_ids) > 0
    AND array_position(posting_account_ids, NULL) IS NULL AND array_position(posting_amounts_nano_usd, NULL) IS NULL
"""

# As the postings guard (0030): it runs as its owner, so it refuses any table
# but ledger_events, sees only pg_catalog and temporary objects, names every
# table with its schema and uses operators of exactly pg_catalog's types. The
# balances are updated in the order of their accounts, for the reason 0030
# gives. Events without arrays (their postings are rows) pass untouched.
APPLY_EVENT_POSTINGS = """
CREATE OR REPLACE FUNCTION "{schema}".paralon_apply_event_postings() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
    unapplied bigint;
BEGIN
    IF TG_RELID <> '"{schema}".ledger_events'::regclass::oid OR TG_OP <> 'INSERT' OR TG_LEVEL <> 'STATEMENT' THEN
        RAISE EXCEPTION 'paralon_apply_event_postings runs only after inserts into ledger_events'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    SELECT n.seq, sum(u.amount) AS total INTO bad
      FROM new_events n CROSS JOIN LATERAL unnest(n.posting_amounts_nano_usd) AS u(amount)
     GROUP BY n.seq HAVING sum(u.amount) <> 0::numeric
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ledger_events: event % refused: its postings sum to % nano-USD, not 0', bad.seq, bad.total
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    WITH moved AS (
        SELECT u.account_id, sum(u.amount)::bigint AS amount, max(n.seq) AS last_seq
          FROM new_events n CROSS JOIN LATERAL unnest(n.posting_account_ids, n.posting_amounts_nano_usd) AS u(account_id, amount)
         GROUP BY u.account_id ORDER BY u.account_id
    ), applied AS (
        UPDATE "{schema}".account_balances AS b
           SET balance_nano_usd = b.balance_nano_usd + m.amount, last_event_seq = greatest(b.last_event_seq, m.last_seq)
          FROM moved m WHERE b.account_id = m.account_id AND b.account_id = ANY(ARRAY(SELECT account_id FROM moved))
        RETURNING b.account_id
    )
    SELECT m.account_id INTO unapplied FROM moved m WHERE m.account_id NOT IN (SELECT account_id FROM applied) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ledger_events: account % has no balance to post to', unapplied
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END $$
"""

# 0030's postings guard, its events read with their arrays: a posting row of
# an event that carries its postings in its row is refused.
_EVENTS_READ = "(SELECT e.seq, e.xmin FROM \"{schema}\".ledger_events e WHERE e.seq BETWEEN lo AND hi) e ON e.seq = n.event_seq\n     WHERE e.xmin IS NULL\n"
_EVENTS_READ_WITH_ARRAYS = ("(SELECT e.seq, e.xmin, e.posting_account_ids FROM \"{schema}\".ledger_events e WHERE e.seq BETWEEN lo AND hi) e"
                            " ON e.seq = n.event_seq\n     WHERE e.xmin IS NULL OR e.posting_account_ids IS NOT NULL\n")
_WHY = "SELECT n.event_seq, 'it names no event this transaction inserted' AS why INTO bad\n"
_WHY_WITH_ARRAYS = ("SELECT n.event_seq, CASE WHEN e.posting_account_ids IS NOT NULL THEN 'its event carries its postings in its row'"
                    " ELSE 'it names no event this transaction inserted' END AS why INTO bad\n")

VIEW_POSTGRES = """
CREATE VIEW ledger_event_postings AS
SELECT p.event_seq, p.leg, p.account_id, p.amount_nano_usd FROM ledger_postings p
UNION ALL
SELECT e.seq, (u.leg - 1)::int, u.account_id, u.amount_nano_usd
  FROM ledger_events e
       CROSS JOIN LATERAL unnest(e.posting_account_ids, e.posting_amounts_nano_usd) WITH ORDINALITY AS u(account_id, amount_nano_usd, leg)
"""
VIEW_SQLITE = "CREATE VIEW ledger_event_postings AS SELECT event_seq, leg, account_id, amount_nano_usd FROM ledger_postings"


def _guard_of_0030() -> str:
    return earlier_revision("0030_balances_moved_by_their_postings.py").GUARD_POSTINGS


def guard_refusing_rows_of_array_events() -> str:
    guard = _guard_of_0030()
    for part in (_EVENTS_READ, _WHY):
        if guard.count(part) != 1:
            raise RuntimeError("0030's postings guard is not what this revision expects")
    return guard.replace(_EVENTS_READ, _EVENTS_READ_WITH_ARRAYS, 1).replace(_WHY, _WHY_WITH_ARRAYS, 1)


def upgrade() -> None:
    op.add_column("ledger_head", sa.Column("postings_in_event_row", sa.Boolean, nullable=False, server_default=sa.false()))
    if op.get_bind().dialect.name != "postgresql":
        op.execute(VIEW_SQLITE)
        return
    schema = op.get_bind().exec_driver_sql("SELECT current_schema()").scalar_one()
    op.execute("ALTER TABLE ledger_events ADD COLUMN posting_account_ids bigint[], ADD COLUMN posting_amounts_nano_usd bigint[]")
    op.execute(f"ALTER TABLE ledger_events ADD CONSTRAINT ck_ledger_events_posting_arrays CHECK ({ARRAYS_CHECK}) NOT VALID")
    op.execute(APPLY_EVENT_POSTINGS.format(schema=schema))
    op.execute(f"REVOKE EXECUTE ON FUNCTION {APPLY} FROM PUBLIC")
    op.execute(f"ALTER FUNCTION {APPLY} SECURITY DEFINER SET search_path = pg_catalog, pg_temp")
    op.execute("CREATE TRIGGER ledger_events_postings AFTER INSERT ON ledger_events REFERENCING NEW TABLE AS new_events "
               f"FOR EACH STATEMENT EXECUTE FUNCTION {APPLY}")
    _replace_guard(guard_refusing_rows_of_array_events().format(schema=schema))
    op.execute(VIEW_POSTGRES)


def _replace_guard(function: str) -> None:
    """CREATE OR REPLACE resets what ALTER FUNCTION set: 0030's settings again."""
    op.execute(function)
    op.execute(f"REVOKE EXECUTE ON FUNCTION {GUARD} FROM PUBLIC")
    op.execute(f"ALTER FUNCTION {GUARD} SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_seqscan = off")


def downgrade() -> None:
    op.execute("DROP VIEW ledger_event_postings")
    if op.get_bind().dialect.name == "postgresql":
        bind = op.get_bind()
        if bind.exec_driver_sql("SELECT EXISTS (SELECT FROM ledger_events WHERE posting_account_ids IS NOT NULL)").scalar_one():
            raise RuntimeError("events carry their postings in their rows: the revision before 0031 cannot read them")
        schema = bind.exec_driver_sql("SELECT current_schema()").scalar_one()
        _replace_guard(_guard_of_0030().format(schema=schema))
        op.execute("DROP TRIGGER ledger_events_postings ON ledger_events")
        op.execute(f"DROP FUNCTION {APPLY}")
        op.execute("ALTER TABLE ledger_events DROP CONSTRAINT ck_ledger_events_posting_arrays")
        op.execute("ALTER TABLE ledger_events DROP COLUMN posting_account_ids, DROP COLUMN posting_amounts_nano_usd")
    with op.batch_alter_table("ledger_head") as batch:
        batch.drop_column("postings_in_event_row")
