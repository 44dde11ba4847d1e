"""The event postings trigger reads each batch's legs once, in one statement.

0031's trigger unnested the legs of every inserted event twice, in two
statements: once to find an event whose legs do not sum to zero, once to move
the balances. Each pass was a lateral `unnest(accounts, amounts)`, which
PostgreSQL runs as a function scan per event, a tuple store built and read
for each. Here the legs are unnested once per statement, in the select list (a
set-returning function there yields its rows one by one, no tuple store per
event), and both aggregates read them from one statement; when an event does
not sum to zero, nothing is updated before the refusal. The trigger runs
under the append lock at every durable append. Measured with
pg_stat_statements (track = all) on batches of 256 settlements, two runs
each, alternating: 0031's two statements took 7.5 and 9.7 µs a settlement,
35% and 34% of the events' COPY that fires them; this one 6.3 and 6.8 µs,
29% and 28%.

The rules, the messages and the function's settings are 0031's.

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-03
"""
from alembic import op

from app.migrate import earlier_revision

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None

APPLY = "paralon_apply_event_postings()"

# As 0031's, but for how the legs are read: the statement returns the first
# event that does not sum to zero, or else the first account moved without a
# balance row (none moves when an event does not sum to zero).
APPLY_EVENT_POSTINGS = """
CREATE OR REPLACE FUNCTION "{schema}".paralon_apply_event_postings() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    unbalanced_seq bigint;
    unbalanced_total numeric;
    unapplied bigint;
BEGIN
    IF TG_RELID <> '"{schema}".ledger_events'::regclass::oid OR TG_OP <> 'INSERT' OR TG_LEVEL <> 'STATEMENT' THEN
        RAISE EXCEPTION 'paralon_apply_event_postings runs only after inserts into ledger_events'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    WITH legs AS MATERIALIZED (
        SELECT n.seq, unnest(n.posting_account_ids) AS account_id, unnest(n.posting_amounts_nano_usd) AS amount
          FROM new_events n
         WHERE n.posting_account_ids IS NOT NULL
    ), unbalanced AS (
        SELECT l.seq, sum(l.amount) AS total FROM legs l GROUP BY l.seq HAVING sum(l.amount) <> 0::numeric ORDER BY l.seq LIMIT 1
    ), moved AS (
        SELECT l.account_id, sum(l.amount)::bigint AS amount, max(l.seq) AS last_seq
          FROM legs l
         WHERE NOT EXISTS (SELECT FROM unbalanced)
         GROUP BY l.account_id ORDER BY l.account_id
    ), applied AS (
        UPDATE "{schema}".account_balances AS b
           SET balance_nano_usd = b.balance_nano_usd + m.amount, last_event_seq = greatest(b.last_event_seq, m.last_seq)
          FROM moved m WHERE b.account_id = m.account_id AND b.account_id = ANY(ARRAY(SELECT account_id FROM moved))
        RETURNING b.account_id
    )
    SELECT u.seq, u.total, (SELECT m.account_id FROM moved m WHERE m.account_id NOT IN (SELECT account_id FROM applied) LIMIT 1)
      INTO unbalanced_seq, unbalanced_total, unapplied
      FROM (SELECT 1) AS one LEFT JOIN unbalanced u ON true;
    IF unbalanced_seq IS NOT NULL THEN
        RAISE EXCEPTION 'ledger_events: event % refused: its postings sum to % nano-USD, not 0', unbalanced_seq, unbalanced_total
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF unapplied IS NOT NULL THEN
        RAISE EXCEPTION 'ledger_events: account % has no balance to post to', unapplied
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END $$
"""


def _replace(function: str) -> None:
    """CREATE OR REPLACE keeps the owner and the grants but resets the settings: 0031's again."""
    op.execute(function.format(schema=op.get_bind().exec_driver_sql("SELECT current_schema()").scalar_one()))
    op.execute(f"ALTER FUNCTION {APPLY} SECURITY DEFINER SET search_path = pg_catalog, pg_temp")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace(APPLY_EVENT_POSTINGS)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace(earlier_revision("0031_postings_in_their_event_row.py").APPLY_EVENT_POSTINGS)
