"""The balance guard sums the postings the append just wrote, by event, and
the postings lose their index by account.

0013's guard summed each changed account's postings over its own range
(old last_event_seq, new last_event_seq] through an index on
(account_id, event_seq): three more index entries per settlement, a third of
what writing the postings costs, under the append lock. An append moves the
chain's head after its balances, in a statement of its own, so when the guard
runs the head still shows where the log stood before the append's events.
The guard now requires of a statement that moves balances:
- every account it moves goes to one event, the same for all (`moved_to`),
  beyond the head and not beyond the last event in the log;
- no account it moves was ahead of the head (none ever is: an account moves
  to the last event of its append, and the head follows it);
- each account moves by exactly the sum of its postings between the head and
  `moved_to`, read in one range of the postings' primary key (event, leg).
- every account with postings in that range moves: an append in this order
  cannot apply a credit and leave its debit out (0013 checked only the
  accounts moved, as it still does for the order below).
Since an account never runs ahead of the head, that range holds every posting
of its old range that is not yet in its balance. Moving the head before the
balances leaves no range, and the balances' move is refused. The rules on
closed holds are 0013's, unchanged.

A release before this one moves balances and head in one statement, so the
guard finds the head already moved by its own transaction (the head row's
xmin): it then checks that statement as 0013 did, each account over its own
range, which without the index reads the postings by event from the
account's last event on. Replicas of that release keep settling during a
rolling deploy, more slowly; once they are replaced, no append takes that
path.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-02
"""
from alembic import op

from app.migrate import earlier_revision

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

GUARD = "paralon_guard_balances()"
POSTINGS_BY_ACCOUNT = ("ix_ledger_postings_account_seq", "ledger_postings", ["account_id", "event_seq"])

_DECLARED = "    bad record;\nBEGIN\n"
_READ_BEFORE = """    bad record;
    head_seq bigint;
    head_moved_here boolean;
    moved_to bigint;
BEGIN
    SELECT last_seq, xmin = (txid_current() % 4294967296)::text::xid INTO head_seq, head_moved_here FROM ledger_head WHERE id = 1;
    SELECT max(n.last_event_seq) INTO moved_to FROM new_rows n JOIN old_rows o ON o.account_id = n.account_id
     WHERE n.balance_nano_usd <> o.balance_nano_usd OR n.last_event_seq <> o.last_event_seq;
"""
_HOLDS_JOIN = "      LEFT JOIN customer_holds c ON c.account_id = n.account_id\n"
_SUMS_JOIN = """      LEFT JOIN (SELECT p.account_id, sum(p.amount_nano_usd) AS total FROM ledger_postings p
                  WHERE p.event_seq > head_seq AND p.event_seq <= moved_to GROUP BY p.account_id) s
             ON s.account_id = n.account_id
"""
_RANGE_BY_ACCOUNT = """               n.last_event_seq < o.last_event_seq
            OR n.last_event_seq > (SELECT max(e.seq) FROM ledger_events e)
            OR n.balance_nano_usd - o.balance_nano_usd <> coalesce((
                   SELECT sum(p.amount_nano_usd) FROM ledger_postings p
                    WHERE p.account_id = n.account_id
                      AND p.event_seq > o.last_event_seq AND p.event_seq <= n.last_event_seq), 0)))
"""
_RANGE_OF_THE_APPEND = """               CASE WHEN head_moved_here THEN ({by_account}
               ) ELSE (
                   n.last_event_seq <> moved_to
                OR o.last_event_seq > head_seq
                OR moved_to <= head_seq
                OR moved_to > (SELECT max(e.seq) FROM ledger_events e)
                OR n.balance_nano_usd - o.balance_nano_usd <> coalesce(s.total, 0)
               ) END))
"""


_REFUSAL = "    IF FOUND THEN\n"
_EVERY_ACCOUNT_POSTED_MOVES = """    IF NOT FOUND AND moved_to IS NOT NULL AND NOT head_moved_here THEN
        SELECT p.account_id, sum(p.amount_nano_usd) AS posted INTO bad FROM ledger_postings p
         WHERE p.event_seq > head_seq AND p.event_seq <= moved_to
           AND NOT EXISTS (SELECT 1 FROM new_rows n WHERE n.account_id = p.account_id AND n.last_event_seq = moved_to)
         GROUP BY p.account_id HAVING sum(p.amount_nano_usd) <> 0 LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'account_balances: account % was posted % nano-USD by events its balance did not move with',
                bad.account_id, bad.posted USING ERRCODE = 'integrity_constraint_violation';
        END IF;
    END IF;
"""


def _guard_of_0013() -> str:
    return earlier_revision("0013_app_role_guard.py").GUARD_BALANCES.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def guard_reading_the_appended_range() -> str:
    guard = _guard_of_0013()
    for part in (_DECLARED, _HOLDS_JOIN, _RANGE_BY_ACCOUNT, _REFUSAL):
        if guard.count(part) != 1:
            raise RuntimeError("0013's balance guard is not what this revision expects")
    return (guard.replace(_DECLARED, _READ_BEFORE, 1)
            .replace(_HOLDS_JOIN, _HOLDS_JOIN + _SUMS_JOIN, 1)
            .replace(_RANGE_BY_ACCOUNT, _RANGE_OF_THE_APPEND.format(by_account="\n" + _RANGE_BY_ACCOUNT.rstrip()[:-2]), 1)
            .replace(_REFUSAL, _EVERY_ACCOUNT_POSTED_MOVES + _REFUSAL, 1))


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(guard_reading_the_appended_range())
        # Its plan is kept for the connection's life: with sequential scans off,
        # one made on a small log still reads the postings' range by index.
        op.execute(f"ALTER FUNCTION {GUARD} SET enable_seqscan = off")
        op.drop_index(POSTINGS_BY_ACCOUNT[0], POSTINGS_BY_ACCOUNT[1])


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_index(*POSTINGS_BY_ACCOUNT)
        op.execute(f"ALTER FUNCTION {GUARD} RESET enable_seqscan")
        op.execute(_guard_of_0013())
