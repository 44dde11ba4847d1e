"""The event postings trigger also closes the batch's holds, in its one update.

Before, each customer's balance row was written twice in a settlement batch:
by this trigger (its balance, moved by the postings) and then by the
statement after the rows (its holds_closed_nano_usd). A second update of a
row the transaction already updated makes a second row version, runs the
foreign-key check to accounts that an update of an untouched row skips, and
fires the balance guard again. Here the writer announces what the batch
closes in two transaction-local settings, `paralon.holds_closed_account_ids`
and `paralon.holds_closed_nano_usd` (array literals, one amount per
customer), and the trigger adds them in the same update that moves the
balances, then clears them: the writer refuses to move the head of a batch
whose announcement no trigger took, so a release deployed before this
migration writes nothing. A release before this one never sets them, and
still closes its holds after its rows, once.

The balance guard still checks every close (never more than was placed,
never backwards), whoever updates the row. Measured with pg_stat_statements
(track = all, track_planning = on) on a scratch server, batches of 512
settlements, execution and planning per batch: before, the trigger 1,430 and
9 µs, the statement after the rows 844 and 166, and 224 of foreign-key checks
(68 a batch); after, the trigger 1,502 and 14, the statement after the rows
113 and 142, no foreign-key check. About 1.7 µs a settlement less.

The rules, the messages and the function's settings are 0033's.

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-03
"""
from alembic import op

from app.migrate import earlier_revision

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None

APPLY = "paralon_apply_event_postings()"

# The announced closes, read where they are used: a statement that read
# them from the function's variables would take them as parameters and be
# planned again at every call (pg_stat_statements: 0.3 ms a batch), where
# one without parameters keeps its plan.
_SETTING = "coalesce(nullif(current_setting('paralon.{name}', true), ''), '{{}}')::bigint[]"
_CLOSED = {"closed_ids": _SETTING.format(name="holds_closed_account_ids"),
           "closed_amounts": _SETTING.format(name="holds_closed_nano_usd")}

# 0033's statement, the announced closes joined to the postings' sums (a
# customer may close holds without a leg in the batch: rows layout, whose
# postings move the balances in their own statement). Both lists are the
# writer's, checked as far as a malformed one could mislead: the lengths
# agree and every account is named once.
APPLY_EVENT_POSTINGS = """
CREATE OR REPLACE FUNCTION "{schema}".paralon_apply_event_postings() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    closed_ids bigint[] := {closed_ids};
    closed_amounts bigint[] := {closed_amounts};
    unbalanced_seq bigint;
    unbalanced_total numeric;
    unapplied bigint;
BEGIN
    IF TG_RELID <> '"{schema}".ledger_events'::regclass::oid OR TG_OP <> 'INSERT' OR TG_LEVEL <> 'STATEMENT' THEN
        RAISE EXCEPTION 'paralon_apply_event_postings runs only after inserts into ledger_events'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF cardinality(closed_ids) <> cardinality(closed_amounts)
       OR cardinality(closed_ids) <> (SELECT count(DISTINCT c) FROM unnest(closed_ids) AS c)
       OR array_position(closed_amounts, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'ledger_events: the holds closed were announced malformed'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    WITH legs AS MATERIALIZED (
        SELECT n.seq, unnest(n.posting_account_ids) AS account_id, unnest(n.posting_amounts_nano_usd) AS amount
          FROM new_events n
         WHERE n.posting_account_ids IS NOT NULL
    ), unbalanced AS (
        SELECT l.seq, sum(l.amount) AS total FROM legs l GROUP BY l.seq HAVING sum(l.amount) <> 0::numeric ORDER BY l.seq LIMIT 1
    ), moved AS (
        SELECT coalesce(s.account_id, c.account_id) AS account_id, coalesce(s.amount, 0::bigint) AS amount, s.last_seq,
               coalesce(c.amount, 0::bigint) AS closed
          FROM (SELECT l.account_id, sum(l.amount)::bigint AS amount, max(l.seq) AS last_seq FROM legs l GROUP BY l.account_id) s
          FULL JOIN unnest({closed_ids}, {closed_amounts}) AS c(account_id, amount) ON c.account_id = s.account_id
         WHERE NOT EXISTS (SELECT FROM unbalanced)
         ORDER BY 1
    ), applied AS (
        UPDATE "{schema}".account_balances AS b
           SET balance_nano_usd = b.balance_nano_usd + m.amount, last_event_seq = greatest(b.last_event_seq, m.last_seq),
               holds_closed_nano_usd = b.holds_closed_nano_usd + m.closed
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
    IF cardinality(closed_ids) > 0 THEN  -- taken: a later statement of the transaction cannot close them again
        PERFORM set_config('paralon.holds_closed_account_ids', '', true), set_config('paralon.holds_closed_nano_usd', '', true);
    END IF;
    RETURN NULL;
END $$
"""


def _replace(function: str) -> None:
    """CREATE OR REPLACE keeps the owner and the grants but resets the settings: 0031's again."""
    op.execute(function.format(schema=op.get_bind().exec_driver_sql("SELECT current_schema()").scalar_one(), **_CLOSED))
    op.execute(f"ALTER FUNCTION {APPLY} SECURITY DEFINER SET search_path = pg_catalog, pg_temp")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace(APPLY_EVENT_POSTINGS)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace(earlier_revision("0033_event_postings_applied_in_one_pass.py").APPLY_EVENT_POSTINGS)
