"""Balances move only with the events that move them; continuous verification.

PostgreSQL (the service runs as a role that owns nothing, so it cannot switch
these triggers off; `app.db_roles` grants it what it needs):
- `account_balances_guard`: after every UPDATE statement on account_balances,
  each changed balance must differ from its old value by exactly the sum of
  the account's postings in (old last_event_seq, new last_event_seq], that
  range moving only forward and never past the last event in the log (so a
  posting written without its event moves nothing); closed holds
  never exceed placed ones (which would make more available than the
  balance). One set-based query per statement over the new index on
  ledger_postings (account_id, event_seq). It fires at the end of the
  statement, so it sees the postings a data-modifying CTE inserted beside it.
- A new balance row starts at zero; the hold and spend-limit counters that
  reserve money never go back (a lowered reservation is money made available).
SQLite has no roles: whoever can write the file can change anything, and
`ledger verify` is what finds it.

Both: `ledger_verifications`, the one row the beat's verification writes
(what it last proved, and whether it passed), read by /metrics.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

from ledger.schema import UTCDateTime

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

GENESIS_HASH = bytes(32)

GUARD_BALANCES = """
CREATE FUNCTION paralon_guard_balances() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    SELECT n.account_id, n.balance_nano_usd - o.balance_nano_usd AS moved INTO bad
      FROM new_rows n JOIN old_rows o ON o.account_id = n.account_id
      LEFT JOIN customer_holds c ON c.account_id = n.account_id
     WHERE n.holds_closed_nano_usd < o.holds_closed_nano_usd
        OR (n.holds_closed_nano_usd > o.holds_closed_nano_usd
            AND n.holds_closed_nano_usd > coalesce(c.holds_placed_nano_usd, 0))
        OR ((n.balance_nano_usd <> o.balance_nano_usd OR n.last_event_seq <> o.last_event_seq) AND (
               n.last_event_seq < o.last_event_seq
            OR n.last_event_seq > (SELECT max(e.seq) FROM ledger_events e)
            OR n.balance_nano_usd - o.balance_nano_usd <> coalesce((
                   SELECT sum(p.amount_nano_usd) FROM ledger_postings p
                    WHERE p.account_id = n.account_id
                      AND p.event_seq > o.last_event_seq AND p.event_seq <= n.last_event_seq), 0)))
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'account_balances: account % cannot change (balance by % nano-USD) without the events that cause it',
            bad.account_id, bad.moved USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END $$
"""

# A refusal for row triggers whose WHEN clause already found the change wrong.
REFUSE_GUARDED = """
CREATE FUNCTION paralon_refuse_guarded_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%: % refused (%)', TG_TABLE_NAME, TG_OP, TG_ARGV[0] USING ERRCODE = 'integrity_constraint_violation';
END $$
"""

GUARD_LIMIT_CLOSED = """
CREATE FUNCTION paralon_guard_limit_closed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.holds_closed_nano_usd > coalesce(
           (SELECT l.holds_placed_nano_usd FROM spend_limit_holds l WHERE l.limit_id = NEW.limit_id), 0) THEN
        RAISE EXCEPTION 'spend_limit_usage: limit % cannot close more than it placed', NEW.limit_id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$
"""

# (trigger name, table, timing and event, WHEN condition, the reason it names)
ROW_GUARDS = (
    ("account_balances_start_at_zero", "account_balances", "BEFORE INSERT",
     "NEW.balance_nano_usd <> 0 OR NEW.holds_closed_nano_usd <> 0", "a balance starts at zero"),
    ("customer_holds_never_lowered", "customer_holds", "BEFORE UPDATE",
     "NEW.holds_placed_nano_usd < OLD.holds_placed_nano_usd", "placed holds are never lowered"),
    ("spend_limit_holds_never_lowered", "spend_limit_holds", "BEFORE UPDATE",
     "NEW.holds_placed_nano_usd < OLD.holds_placed_nano_usd", "placed holds are never lowered"),
    ("spend_limit_usage_never_lowered", "spend_limit_usage", "BEFORE UPDATE",
     "NEW.spent_nano_usd < OLD.spent_nano_usd OR NEW.holds_closed_nano_usd < OLD.holds_closed_nano_usd",
     "spent and closed are never lowered"),
)


def upgrade() -> None:
    op.create_table(
        "ledger_verifications",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("verified_seq", sa.BigInteger, nullable=False),  # the chain is proven up to here
        sa.Column("verified_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("checked_at", UTCDateTime),  # NULL: never run
        sa.Column("ok", sa.Boolean),
        sa.Column("problems_total", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("first_problem", sa.Text),
        sa.CheckConstraint("id = 1", name="ck_ledger_verifications_single_row"),
    )
    op.get_bind().execute(sa.text("INSERT INTO ledger_verifications (id, verified_seq, verified_hash) VALUES (1, 0, :h)"),
                          {"h": GENESIS_HASH})
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_index("ix_ledger_postings_account_seq", "ledger_postings", ["account_id", "event_seq"])
    op.execute(GUARD_BALANCES)
    op.execute("CREATE TRIGGER account_balances_guard AFTER UPDATE ON account_balances "
               "REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows "
               "FOR EACH STATEMENT EXECUTE FUNCTION paralon_guard_balances()")
    op.execute(REFUSE_GUARDED)
    for name, table, when, condition, reason in ROW_GUARDS:
        op.execute(f"CREATE TRIGGER {name} {when} ON {table} FOR EACH ROW WHEN ({condition}) "
                   f"EXECUTE FUNCTION paralon_refuse_guarded_change('{reason}')")
    op.execute(GUARD_LIMIT_CLOSED)
    op.execute("CREATE TRIGGER spend_limit_usage_closed_guard AFTER UPDATE ON spend_limit_usage FOR EACH ROW "
               "WHEN (NEW.holds_closed_nano_usd > OLD.holds_closed_nano_usd) EXECUTE FUNCTION paralon_guard_limit_closed()")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER spend_limit_usage_closed_guard ON spend_limit_usage")
        op.execute("DROP FUNCTION paralon_guard_limit_closed()")
        for name, table, *_ in ROW_GUARDS:
            op.execute(f"DROP TRIGGER {name} ON {table}")
        op.execute("DROP FUNCTION paralon_refuse_guarded_change()")
        op.execute("DROP TRIGGER account_balances_guard ON account_balances")
        op.execute("DROP FUNCTION paralon_guard_balances()")
        op.drop_index("ix_ledger_postings_account_seq", "ledger_postings")
    op.drop_table("ledger_verifications")
