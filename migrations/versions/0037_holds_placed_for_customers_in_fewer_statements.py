"""The hold function places a common batch in six statements, not eleven.

Under arriving traffic the holds' writer takes what is queued, some 18 holds
a call at 16,000 requests a second (`ledger_throughput.py --arrivals-per-s`),
and a call's fixed cost outweighs its holds: about 270 µs of the server
before 7 µs a hold. Timed inside 0036's function (`clock_timestamp()`
between its statements, a hold a call), its statements took 158 µs, each
5 to 29: every one starts and ends an executor of its own.

A batch that names no spend limit, whose accounts are all customers' and
each covers the sum of its requests, is now placed by: the lock of its
customers' rows (as before, in account order); one read, after it, of what
each customer has available and is asked for; the holds' ids; the insert of
its holds with the update of the placed sums, in one statement; and the
answer. The lock, the read and the writes are one block, which catches a
key placed before: the block is undone, locks and all, and the batch takes
0036's path, unchanged, as does any other batch. The read is a statement of
its own after the lock's, as 0036's was, so that it sees a debit committed
while the lock was awaited. The lock inside the block makes the rows'
updater their locker: locked by the transaction and updated in a
subtransaction, each row took a multixact, 54 bytes more WAL a call.

`benchmarks/holds_writes.py --before 0037` (EXPLAIN ANALYZE of the call,
alternated with a database put back to 0036's function), the server's time
a hold: 171 against 214.5 µs a call of one hold (0.797, 400 rounds), 22.75
against 26.28 at 16 a call (0.866), 6.41 against 7.03 at 256 (0.912); the
WAL the same.

The rules, the answers and the function's settings are 0036's.

Revision ID: 0037
Revises: 0036
Create Date: 2026-12-04
"""
from alembic import op

from app.migrate import earlier_revision

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None

_of_0036 = earlier_revision("0036_holds_placed_without_looking_their_keys_up.py")
_SKIP_FLUSH_WAIT = "    PERFORM set_config('synchronous_commit', 'off', true);\n"
_NEW_IDS_DECLARED = "    new_ids bigint[];\n"

COVERED_DECLARED = "    covered boolean;  -- the common batch: its customers cover it\n"
COMMON_BATCH = """\
    -- The common batch: no spend limit named, every account a customer's that
    -- covers the sum of its requests, no key placed before. Its holds and its
    -- customers' placed sums are written by one statement.
    IF cardinality(array_remove(p_limit, NULL)) = 0 THEN
        -- In one block, the lock too: the rows' updater is then their locker, one
        -- subtransaction, where an update under the transaction's own lock takes a
        -- multixact (WAL of its own). A key placed before undoes the block, locks and all.
        BEGIN
            PERFORM 1 FROM customer_holds c WHERE c.account_id = ANY(p_account) ORDER BY c.account_id FOR UPDATE;
            -- A statement after the lock's: its snapshot sees what committed while the lock was awaited.
            WITH w AS (SELECT r.account_id, sum(r.amount)::bigint AS wanted
                         FROM unnest(p_account, p_amount) AS r(account_id, amount) GROUP BY r.account_id)
            SELECT array_agg(w.account_id ORDER BY w.account_id), array_agg(w.wanted ORDER BY w.account_id),
                   count(b.account_id) = count(*) AND coalesce(bool_and(
                       b.balance_nano_usd - (c.holds_placed_nano_usd - b.holds_closed_nano_usd) >= w.wanted), false)
              INTO acc_ids, acc_wanted, covered
              FROM w LEFT JOIN accounts a ON a.id = w.account_id AND a.kind = 'customer'
                     LEFT JOIN customer_holds c ON c.account_id = a.id
                     LEFT JOIN account_balances b ON b.account_id = c.account_id;
            IF covered THEN
                new_ids := ARRAY(SELECT nextval('holds_id_seq') FROM generate_series(1, n));
                WITH placed AS (
                    UPDATE customer_holds c SET holds_placed_nano_usd = c.holds_placed_nano_usd + u.wanted
                      FROM unnest(acc_ids, acc_wanted) AS u(account_id, wanted) WHERE c.account_id = u.account_id)
                INSERT INTO holds (id, account_id, amount_nano_usd, idempotency_key, created_at, expires_at, replica_id)
                SELECT r.id, r.account_id, r.amount, r.key, p_now, p_now + make_interval(secs => r.ttl_s), r.replica_id
                  FROM unnest(new_ids, p_account, p_amount, p_key, p_ttl_s, p_replica)
                       AS r(id, account_id, amount, key, ttl_s, replica_id);
            END IF;
        EXCEPTION WHEN unique_violation THEN
            new_ids := NULL;  -- both writes undone: the path below reads the keys and decides each request
        END;
        IF new_ids IS NOT NULL THEN
            RETURN QUERY
            SELECT (r.pos - 1)::int, 'created'::text, r.id, r.amount, p_now + make_interval(secs => r.ttl_s), NULL::text
              FROM unnest(new_ids, p_amount, p_ttl_s) WITH ORDINALITY AS r(id, amount, ttl_s, pos);
            RETURN;
        END IF;
    END IF;
"""


def place_holds_function() -> str:
    """0036's function, the common batch's path first."""
    original = _of_0036.PLACE_HOLDS
    if original.count(_SKIP_FLUSH_WAIT) != 1 or original.count(_NEW_IDS_DECLARED) != 1:
        raise RuntimeError("0036's hold function is not as this migration expects it")
    return (original.replace(_NEW_IDS_DECLARED, _NEW_IDS_DECLARED + COVERED_DECLARED, 1)
            .replace(_SKIP_FLUSH_WAIT, _SKIP_FLUSH_WAIT + COMMON_BATCH, 1))


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in (place_holds_function(), *_of_0036.FUNCTION_SETTINGS):
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in (_of_0036.PLACE_HOLDS, *_of_0036.FUNCTION_SETTINGS):
            op.execute(statement)
