"""The event postings trigger checks each event's sum by its row, and reads the legs once.

0035's trigger unnested every leg into a materialised table, then grouped it
twice: by event, to find one whose legs do not sum to zero, and by account,
to move the balances. Here an event's sum is checked on its own row, without
its legs leaving their array: a settlement's three legs (most of every
batch) are added in place, and only an event of any other length unnests
its own. The legs are then unnested once, in the statement that groups them
by account, and never stored. Three bigints whose sum is out of range cannot
sum to zero: the check's overflow is caught, and the event's sum is then
found in numeric, as before, for the same refusal. The trigger runs under
the append lock at every durable append. Measured with pg_stat_statements
(`benchmarks/statement_costs.py`, batches of 256 settlements, two runs each,
alternating): 0035's statement took 11.7 and 11.5 µs a settlement, these two
9.0 and 9.4 (the sums' check 0.7 and 0.8 of it); the events' COPY that fires
them fell from 34.5 and 35.5 µs to 32.8 and 33.8.

The rules, the messages and the function's settings are 0035's; when an
event does not sum to zero, nothing is updated before the refusal.

Revision ID: 0039
Revises: 0038
Create Date: 2026-12-05
"""
from alembic import op

from app.migrate import earlier_revision

revision = "0039"
down_revision = "0038"
branch_labels = None
depends_on = None

# The first event whose legs do not sum to zero, by its row: WHERE's CASE
# runs the short branch for three legs, the subquery for any other number.
# `first_leg` is the first of the three as added: bigint, or numeric after an overflow.
_FIRST_UNBALANCED = """
        SELECT n.seq INTO unbalanced_seq
          FROM new_events n
         WHERE n.posting_amounts_nano_usd IS NOT NULL AND CASE cardinality(n.posting_amounts_nano_usd)
               WHEN 3 THEN {first_leg} + n.posting_amounts_nano_usd[2] + n.posting_amounts_nano_usd[3] <> 0
               ELSE (SELECT sum(a) FROM unnest(n.posting_amounts_nano_usd) AS a) <> 0::numeric END
         ORDER BY n.seq LIMIT 1;"""
_IN_BIGINT = _FIRST_UNBALANCED.format(first_leg="n.posting_amounts_nano_usd[1]")
_IN_NUMERIC = _FIRST_UNBALANCED.format(first_leg="n.posting_amounts_nano_usd[1]::numeric")

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
    BEGIN""" + _IN_BIGINT + """
    EXCEPTION WHEN numeric_value_out_of_range THEN  -- three legs out of bigint's range: their sum in numeric""" + _IN_NUMERIC + """
    END;
    IF unbalanced_seq IS NOT NULL THEN
        SELECT sum(a) INTO unbalanced_total FROM new_events n, unnest(n.posting_amounts_nano_usd) AS a WHERE n.seq = unbalanced_seq;
        RAISE EXCEPTION 'ledger_events: event % refused: its postings sum to % nano-USD, not 0', unbalanced_seq, unbalanced_total
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    WITH moved AS (
        SELECT coalesce(s.account_id, c.account_id) AS account_id, coalesce(s.amount, 0::bigint) AS amount, s.last_seq,
               coalesce(c.amount, 0::bigint) AS closed
          FROM (SELECT l.account_id, sum(l.amount)::bigint AS amount, max(l.seq) AS last_seq
                  FROM (SELECT n.seq, unnest(n.posting_account_ids) AS account_id, unnest(n.posting_amounts_nano_usd) AS amount
                          FROM new_events n WHERE n.posting_account_ids IS NOT NULL) AS l
                 GROUP BY l.account_id) AS s
          FULL JOIN unnest({closed_ids}, {closed_amounts}) AS c(account_id, amount) ON c.account_id = s.account_id
         ORDER BY 1
    ), applied AS (
        UPDATE "{schema}".account_balances AS b
           SET balance_nano_usd = b.balance_nano_usd + m.amount, last_event_seq = greatest(b.last_event_seq, m.last_seq),
               holds_closed_nano_usd = b.holds_closed_nano_usd + m.closed
          FROM moved m WHERE b.account_id = m.account_id AND b.account_id = ANY(ARRAY(SELECT account_id FROM moved))
        RETURNING b.account_id
    )
    SELECT m.account_id INTO unapplied FROM moved m WHERE m.account_id NOT IN (SELECT account_id FROM applied) LIMIT 1;
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


def _revision_0035():
    """0035's announced closes and its way of replacing the function (its settings set again)."""
    return earlier_revision("0035_holds_closed_moved_with_postings.py")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _revision_0035()._replace(APPLY_EVENT_POSTINGS)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        revision_0035 = _revision_0035()
        revision_0035._replace(revision_0035.closes_applied_with_postings())
