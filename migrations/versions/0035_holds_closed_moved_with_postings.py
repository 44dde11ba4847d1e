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

# 0033's function, the announced closes checked first, joined to the
# postings' sums (a customer may close holds without a leg in the batch: rows
# layout, whose postings move the balances in their own statement), added in
# the same update, then cleared. Both lists are the writer's, checked as far
# as a malformed one could mislead: the lengths agree and every account is
# named once.
_CLOSED_DECLARED = """DECLARE
    closed_ids bigint[] := {closed_ids};
    closed_amounts bigint[] := {closed_amounts};
"""
_CLOSED_CHECKED = """
    IF cardinality(closed_ids) <> cardinality(closed_amounts)
       OR cardinality(closed_ids) <> (SELECT count(DISTINCT c) FROM unnest(closed_ids) AS c)
       OR array_position(closed_amounts, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'ledger_events: the holds closed were announced malformed'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;"""
_MOVED = """    ), moved AS (
        SELECT l.account_id, sum(l.amount)::bigint AS amount, max(l.seq) AS last_seq
          FROM legs l
         WHERE NOT EXISTS (SELECT FROM unbalanced)
         GROUP BY l.account_id ORDER BY l.account_id
"""
_MOVED_AND_CLOSED = """    ), moved AS (
        SELECT coalesce(s.account_id, c.account_id) AS account_id, coalesce(s.amount, 0::bigint) AS amount, s.last_seq,
               coalesce(c.amount, 0::bigint) AS closed
          FROM (SELECT l.account_id, sum(l.amount)::bigint AS amount, max(l.seq) AS last_seq FROM legs l GROUP BY l.account_id) s
          FULL JOIN unnest({closed_ids}, {closed_amounts}) AS c(account_id, amount) ON c.account_id = s.account_id
         WHERE NOT EXISTS (SELECT FROM unbalanced)
         ORDER BY 1
"""
_SET = "last_event_seq = greatest(b.last_event_seq, m.last_seq)\n"
_CLOSED_TAKEN = """    IF cardinality(closed_ids) > 0 THEN  -- taken: a later statement of the transaction cannot close them again
        PERFORM set_config('paralon.holds_closed_account_ids', '', true), set_config('paralon.holds_closed_nano_usd', '', true);
    END IF;
"""
_PARTS = {  # 0033's text: what this revision adds after it, or puts in its place
    "DECLARE\n": _CLOSED_DECLARED,
    "            USING ERRCODE = 'insufficient_privilege';\n    END IF;": (
        "            USING ERRCODE = 'insufficient_privilege';\n    END IF;" + _CLOSED_CHECKED),
    _MOVED: _MOVED_AND_CLOSED,
    _SET: _SET.replace("\n", ",\n               holds_closed_nano_usd = b.holds_closed_nano_usd + m.closed\n"),
    "    RETURN NULL;\n": _CLOSED_TAKEN + "    RETURN NULL;\n",
}


def _function_of_0033() -> str:
    return earlier_revision("0033_event_postings_applied_in_one_pass.py").APPLY_EVENT_POSTINGS


def closes_applied_with_postings() -> str:
    function = _function_of_0033()
    for part, replacement in _PARTS.items():
        if function.count(part) != 1:
            raise RuntimeError("0033's event postings trigger is not what this revision expects")
        function = function.replace(part, replacement, 1)
    return function


def _replace(function: str) -> None:
    """CREATE OR REPLACE keeps the owner and the grants but resets the settings: 0031's again."""
    op.execute(function.format(schema=op.get_bind().exec_driver_sql("SELECT current_schema()").scalar_one(), **_CLOSED))
    op.execute(f"ALTER FUNCTION {APPLY} SECURITY DEFINER SET search_path = pg_catalog, pg_temp")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace(closes_applied_with_postings())


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace(_function_of_0033())
