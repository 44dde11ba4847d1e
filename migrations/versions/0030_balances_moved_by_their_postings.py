"""Balances are moved by the database, from the postings themselves.

Until now the durable writer sent each account's new balance, and the
balance guard (0013) checked, account by account, that it had moved by
exactly the sum of the account's postings since its last event: a range read
of ledger_postings by (account, event), an index that every posting paid
for on the append's path (measured: 4.8 of the 14 µs each settlement's three
posting rows cost the server).

Now the postings guard (0016, 0026, 0029), which already checks each COPY's
postings, also applies them: each account's balance moves by the sum of its
new postings and its last_event_seq to the last of them, in the same
statement. The function runs as its owner (SECURITY DEFINER, its search path
fixed), and the balance guard refuses a balance moved by anything else, so
no balance moves but by a posting; a posting can only be inserted beside an
event the same transaction inserted, summing to zero with its event's
others. The rule the sum check enforced is kept by construction, and the
guard no longer reads postings, so their index by account goes. It keeps
its checks of closed holds.

The service's role keeps its right to update balance_nano_usd and
last_event_seq: a replica of the previous release, during a rolling deploy,
still sets each balance it touched to the value it decided, which the
postings have just set, and last_event_seq forward; neither moves a balance.
The writer of this release sends the balances it decided too, and refuses
its batch unless the postings moved them there (`ledger.storage.postgres`):
on a database without this revision, its postings would move nothing.

Running as its owner, the function must never run for a table of a
caller's own: it refuses any table but ledger_postings, and no one may
execute it (so no one can attach it to a temporary table). It sees only
pg_catalog and temporary objects, names the schema's tables itself, and uses
only operators of exactly pg_catalog's types (see GUARD_POSTINGS). Every
function's search path is pinned after each migration
(`app.db_roles.harden_functions`).

SQLite has no roles: the writer still sets balances there, and `ledger
verify` is what proves them.

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

GUARD = "paralon_guard_postings()"

# 0029's checks, then the move. It runs as its owner, so it trusts nothing a
# caller could bring along: it refuses to run for any table but
# ledger_postings (a temporary table's rows and column types would be the
# caller's); its search path is pg_catalog and then only temporary objects,
# which are never searched for functions or operators, and every table is
# named with its schema; and every operator has exactly pg_catalog's types
# (numeric <> numeric, oid <> oid, text || text), since an operator with the
# exact types elsewhere would win over one that needs a cast.
#
# Each account posted to must have its balance row (accounts are created with
# one), or money would vanish from the sum. The rows are updated in the order
# of their accounts, as releases update them, so that the two do not
# deadlock: `moved` is materialised in that order (it is read twice), and
# account_balances is read by its key for exactly those accounts (the array),
# so whether the join hashes them or walks either side in order, the rows
# come out, and are locked, in that order; without the array a merge join
# walked the whole key index. (A lock taken in order first, by its own
# statement, cost about 4% of the append backend's CPU.)
GUARD_POSTINGS = """
CREATE OR REPLACE FUNCTION "{schema}".paralon_guard_postings() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    current_full bigint := txid_current();
    current_low bigint := current_full % 4294967296;
    lo bigint;
    hi bigint;
    bad record;
    unapplied bigint;
BEGIN
    IF TG_RELID <> '"{schema}".ledger_postings'::regclass::oid OR TG_OP <> 'INSERT' OR TG_LEVEL <> 'STATEMENT' THEN
        RAISE EXCEPTION 'paralon_guard_postings runs only after inserts into ledger_postings'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    SELECT min(event_seq), max(event_seq) INTO lo, hi FROM new_postings;
    SELECT n.event_seq, 'it names no event this transaction inserted' AS why INTO bad
      FROM (SELECT DISTINCT event_seq FROM new_postings) n
      LEFT JOIN (SELECT e.seq, e.xmin FROM "{schema}".ledger_events e WHERE e.seq BETWEEN lo AND hi) e ON e.seq = n.event_seq
     WHERE e.xmin IS NULL
        OR (NOT e.xmin = current_low::text::xid
            AND pg_xact_status(greatest(current_full
                + ((e.xmin::text::bigint - current_low + 6442450944) % 4294967296) - 2147483648, 0)::text::xid8)
                IS DISTINCT FROM 'in progress')
     LIMIT 1;
    IF NOT FOUND THEN
        SELECT s.event_seq, 'its postings sum to ' || s.total::text || ' nano-USD, not 0' AS why INTO bad
          FROM (SELECT event_seq, sum(amount_nano_usd) AS total FROM new_postings GROUP BY event_seq) s
         WHERE s.total <> 0::numeric
         LIMIT 1;
    END IF;
    IF FOUND THEN
        RAISE EXCEPTION 'ledger_postings: a posting of event % refused: %', bad.event_seq, bad.why
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    WITH moved AS (
        SELECT account_id, sum(amount_nano_usd)::bigint AS amount, max(event_seq) AS last_seq
          FROM new_postings GROUP BY account_id ORDER BY account_id
    ), applied AS (
        UPDATE "{schema}".account_balances AS b
           SET balance_nano_usd = b.balance_nano_usd + m.amount, last_event_seq = greatest(b.last_event_seq, m.last_seq)
          FROM moved m WHERE b.account_id = m.account_id AND b.account_id = ANY(ARRAY(SELECT account_id FROM moved))
        RETURNING b.account_id
    )
    SELECT m.account_id INTO unapplied FROM moved m WHERE m.account_id NOT IN (SELECT account_id FROM applied) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ledger_postings: account % has no balance to post to', unapplied
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END $$
"""


# 0013's guard without the sum over postings. A balance moves only inside the
# postings' function: at trigger depth 2 and as its owner. Not by the service
# directly, nor by a trigger of its own (it may create temporary ones), nor by
# the owner without switching this guard off. last_event_seq only moves
# forward, and never past the log's last event.
#
# The statement's old and new rows are joined by hashing (nested loops off for
# the function): transition tables have no statistics, and the nested loop
# the planner chose compared every new row with every old one, 60 to 90 ms
# for 1,000 balances against 4 to 9 ms hashed. A batch of settlements for
# many customers updates that many. The placed holds are read only for a
# balance that closed more, by its key.
GUARD_BALANCES = """
CREATE OR REPLACE FUNCTION paralon_guard_balances() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    by_postings boolean := pg_trigger_depth() > 1
        AND current_user = (SELECT pg_catalog.pg_get_userbyid(c.relowner) FROM pg_catalog.pg_class c WHERE c.oid = TG_RELID);
    bad record;
BEGIN
    SELECT n.account_id, n.balance_nano_usd - o.balance_nano_usd AS moved INTO bad
      FROM new_rows n JOIN old_rows o ON o.account_id = n.account_id
     WHERE n.holds_closed_nano_usd < o.holds_closed_nano_usd
        OR (n.balance_nano_usd <> o.balance_nano_usd AND NOT by_postings)
        OR (n.last_event_seq <> o.last_event_seq AND (n.last_event_seq < o.last_event_seq
            OR n.last_event_seq > (SELECT coalesce(max(e.seq), 0) FROM ledger_events e)))
        OR (n.holds_closed_nano_usd > o.holds_closed_nano_usd AND n.holds_closed_nano_usd > coalesce(
               (SELECT c.holds_placed_nano_usd FROM customer_holds c WHERE c.account_id = n.account_id), 0))
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'account_balances: account % cannot change (balance by % nano-USD) without the events that cause it',
            bad.account_id, bad.moved USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
END $$
"""
BALANCE_GUARD = "paralon_guard_balances()"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    # CREATE OR REPLACE resets what ALTER FUNCTION set: 0029's plan setting too.
    schema = op.get_bind().exec_driver_sql("SELECT current_schema()").scalar_one()
    op.execute(GUARD_POSTINGS.format(schema=schema))
    op.execute(f"REVOKE EXECUTE ON FUNCTION {GUARD} FROM PUBLIC")
    op.execute(f"ALTER FUNCTION {GUARD} SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_seqscan = off")
    op.execute(GUARD_BALANCES)
    op.execute(f"ALTER FUNCTION {BALANCE_GUARD} SET enable_nestloop = off")
    op.drop_index("ix_ledger_postings_account_seq", "ledger_postings")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_index("ix_ledger_postings_account_seq", "ledger_postings", ["account_id", "event_seq"])
    op.execute(earlier_revision("0013_app_role_guard.py").GUARD_BALANCES.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    op.execute(f"ALTER FUNCTION {BALANCE_GUARD} RESET enable_nestloop")
    op.execute(earlier_revision("0029_postings_guard_reads_events_by_index.py").guard_reading_by_index())
    op.execute(f"ALTER FUNCTION {GUARD} SECURITY INVOKER RESET search_path SET enable_seqscan = off")
