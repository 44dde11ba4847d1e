"""The hold function places a common batch in six statements, not eleven (eight with spend limits).

Under arriving traffic the holds' writer takes what is queued, some 18 holds
a call at 16,000 requests a second (`ledger_throughput.py --arrivals-per-s`),
and a call's fixed cost outweighs its holds: about 270 µs of the server
before 7 µs a hold. Timed inside 0036's function (`clock_timestamp()`
between its statements, a hold a call), its statements took 158 µs, each
5 to 29: every one starts and ends an executor of its own.

A batch whose accounts are all customers' and, with every spend limit it
names, cover the sum of its requests is now placed by: the lock of its
customers' rows (as before, in account order), then of its limits' if it
names any; one read, after them, of what each customer has available and is
asked for (and one of each limit, if any); the update of the limits' placed
sums, if any; the holds' ids; the insert of its holds with the update of the
customers' placed sums, in one statement; and the answer. The locks, the
reads and the writes are one block, which catches a key placed before: the
block is undone, locks and all, and the batch takes 0036's path, unchanged,
as does any other batch. The reads are statements of their own after the
locks', as 0036's were, so that they see a debit committed while a lock was
awaited (a refund's), or the holds another customer placed against the same
limit. The locks inside the block make the rows' updater their locker:
locked by the transaction and updated in a subtransaction, each row took a
multixact, 54 bytes more WAL a call.

`benchmarks/holds_writes.py --before 0037` (EXPLAIN ANALYZE of the call,
alternated with a database put back to 0036's function), the server's time
a hold, no limit named: 183 and 168 against 220 and 207 µs a call of one
hold (0.832 and 0.812, 400 rounds each), 21.81 against 24.06 at 16 a call
(0.906), 6.83 against 7.25 at 256 (0.942); the WAL the same.

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

COVERED_DECLARED = "    covered boolean;  -- the common batch: its customers (and spend limits) cover it\n"
COMMON_BATCH = """\
    -- The common batch: every account a customer's, each customer and each spend
    -- limit named covering the sum of its requests, no key placed before. Its
    -- holds and the customers' placed sums are written by one statement. The
    -- locks are in the block too: the rows' updater is then their locker, one
    -- subtransaction, where an update under the transaction's own lock takes a
    -- multixact (WAL of its own). A key placed before undoes the block, locks and all.
    BEGIN
        PERFORM 1 FROM customer_holds c WHERE c.account_id = ANY(p_account) ORDER BY c.account_id FOR UPDATE;
        IF cardinality(array_remove(p_limit, NULL)) > 0 THEN
            PERFORM 1 FROM spend_limit_holds l WHERE l.limit_id = ANY(p_limit) ORDER BY l.limit_id FOR UPDATE;
        END IF;
        -- Statements after the locks': their snapshots see what committed while the locks were awaited.
        WITH w AS (SELECT r.account_id, sum(r.amount)::bigint AS wanted
                     FROM unnest(p_account, p_amount) AS r(account_id, amount) GROUP BY r.account_id)
        SELECT array_agg(w.account_id ORDER BY w.account_id), array_agg(w.wanted ORDER BY w.account_id),
               count(b.account_id) = count(*) AND coalesce(bool_and(
                   b.balance_nano_usd - (c.holds_placed_nano_usd - b.holds_closed_nano_usd) >= w.wanted), false)
          INTO acc_ids, acc_wanted, covered
          FROM w LEFT JOIN accounts a ON a.id = w.account_id AND a.kind = 'customer'
                 LEFT JOIN customer_holds c ON c.account_id = a.id
                 LEFT JOIN account_balances b ON b.account_id = c.account_id;
        IF covered AND cardinality(array_remove(p_limit, NULL)) > 0 THEN
            WITH w AS (SELECT r.limit_id, sum(r.amount)::bigint AS wanted
                         FROM unnest(p_limit, p_amount) AS r(limit_id, amount) WHERE r.limit_id IS NOT NULL GROUP BY r.limit_id)
            SELECT array_agg(w.limit_id ORDER BY w.limit_id), array_agg(w.wanted ORDER BY w.limit_id),
                   count(u.limit_id) = count(*) AND coalesce(bool_and(
                       l.limit_nano_usd - u.spent_nano_usd - (l.holds_placed_nano_usd - u.holds_closed_nano_usd) >= w.wanted), false)
              INTO lim_ids, lim_wanted, covered
              FROM w LEFT JOIN spend_limit_holds l ON l.limit_id = w.limit_id
                     LEFT JOIN spend_limit_usage u ON u.limit_id = l.limit_id;
        END IF;
        IF covered THEN
            IF lim_ids IS NOT NULL THEN
                UPDATE spend_limit_holds l SET holds_placed_nano_usd = l.holds_placed_nano_usd + u.wanted
                  FROM unnest(lim_ids, lim_wanted) AS u(limit_id, wanted) WHERE l.limit_id = u.limit_id;
            END IF;
            new_ids := ARRAY(SELECT nextval('holds_id_seq') FROM generate_series(1, n));
            WITH placed AS (
                UPDATE customer_holds c SET holds_placed_nano_usd = c.holds_placed_nano_usd + u.wanted
                  FROM unnest(acc_ids, acc_wanted) AS u(account_id, wanted) WHERE c.account_id = u.account_id)
            INSERT INTO holds (id, account_id, amount_nano_usd, idempotency_key, created_at, expires_at, spend_limit_id, replica_id)
            SELECT r.id, r.account_id, r.amount, r.key, p_now, p_now + make_interval(secs => r.ttl_s), r.limit_id, r.replica_id
              FROM unnest(new_ids, p_account, p_amount, p_key, p_ttl_s, p_limit, p_replica)
                   AS r(id, account_id, amount, key, ttl_s, limit_id, replica_id);
        END IF;
    EXCEPTION WHEN unique_violation THEN
        new_ids := NULL;  -- the writes undone: the path below reads the keys and decides each request
    END;
    IF new_ids IS NOT NULL THEN
        RETURN QUERY
        SELECT (r.pos - 1)::int, 'created'::text, r.id, r.amount, p_now + make_interval(secs => r.ttl_s), NULL::text
          FROM unnest(new_ids, p_amount, p_ttl_s) WITH ORDINALITY AS r(id, amount, ttl_s, pos);
        RETURN;
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


def function_of_0036() -> list[str]:
    """The statements that put 0036's function back."""
    return [_of_0036.PLACE_HOLDS, *_of_0036.FUNCTION_SETTINGS]


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in function_of_0036():
            op.execute(statement)
