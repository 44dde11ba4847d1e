"""The hold function inserts a batch without looking its keys up first.

0028's function read every key of the batch from `holds` before deciding
(a retried placement must get the hold it placed before), and only a batch
with no key seen before took the set-based insert. Almost every batch is
such a batch, and the insert's unique index looks each key up again: the
first lookup was a second descent of the keys' index per hold, a sixth of
the placing backend's CPU (`perf record` of it during a throughput round:
`btgettuple` 16%, `btinsert` 26%).

Now a batch whose customers and limits cover all of it is inserted at once,
in a block that catches the unique index's refusal: a key placed before
(or placed meanwhile by another replica, whose transaction the insert
waits for) undoes the insert, and the batch is decided request by request
as before, its keys read first. The holds' ids are taken from the
sequence before the insert, so the answer needs no join of the inserted
rows to the requests by their keys.

The rules, the answers and the function's settings are 0028's.

Revision ID: 0036
Revises: 0035
Create Date: 2026-12-04
"""
from alembic import op

from app.migrate import earlier_revision

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None

SIGNATURE = "paralon_place_holds(bigint[], bigint[], bigint[], text[], int[], bigint[], text[], timestamptz)"


def _decided_one_by_one() -> str:
    """0015's loop over the requests and the insert of what it decided, as
    that revision wrote them (0028 wrapped the same part, between the same
    two lines)."""
    of_0028 = earlier_revision("0028_holds_granted_in_full_without_a_loop.py")
    original = earlier_revision("0015_hold_replicas.py").PLACE_HOLDS
    start, end = original.index(of_0028._LOOP_STARTS), original.index(of_0028._LOOP_WRITTEN) + len(of_0028._LOOP_WRITTEN)
    return original[start:end]


PLACE_HOLDS = """
CREATE OR REPLACE FUNCTION paralon_place_holds(
    p_account bigint[], p_amount bigint[], p_minimum bigint[], p_key text[], p_ttl_s int[], p_limit bigint[],
    p_replica text[], p_now timestamptz
) RETURNS TABLE (idx int, status text, hold_id bigint, amount_nano_usd bigint, expires_at timestamptz, error_code text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    n int := coalesce(cardinality(p_key), 0);
    -- Active holds already stored under these keys (the caller sends each key once).
    ex_keys text[]; ex_accounts bigint[]; ex_amounts bigint[]; ex_ids bigint[]; ex_expires timestamptz[]; ex_limits bigint[];
    -- Per customer, by position in acc_ids: kind, what is available, what this batch asks and placed.
    acc_ids bigint[]; acc_kinds text[]; acc_available bigint[]; acc_wanted bigint[]; acc_placed bigint[];
    -- Per spend limit, by position in lim_ids: what is available, what this batch asks and placed.
    lim_ids bigint[]; lim_available bigint[]; lim_wanted bigint[]; lim_placed bigint[];
    -- The whole batch inserted at once: each request's hold id; NULL when it is decided request by request.
    new_ids bigint[];
    -- The decision for each request, when decided one by one.
    r_status text[] := array_fill(NULL::text, ARRAY[n]);
    r_hold bigint[] := array_fill(NULL::bigint, ARRAY[n]);
    r_amount bigint[] := array_fill(NULL::bigint, ARRAY[n]);
    r_expires timestamptz[] := array_fill(NULL::timestamptz, ARRAY[n]);
    r_error text[] := array_fill(NULL::text, ARRAY[n]);
    e int; j int; k int; want bigint; lowest bigint; granted bigint;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM 1 FROM customer_holds c WHERE c.account_id = ANY(p_account) ORDER BY c.account_id FOR UPDATE;
    SELECT array_agg(a.id ORDER BY a.id), array_agg(a.kind ORDER BY a.id),
           array_agg(b.balance_nano_usd - (coalesce(c.holds_placed_nano_usd, 0) - b.holds_closed_nano_usd) ORDER BY a.id)
      INTO acc_ids, acc_kinds, acc_available
      FROM accounts a JOIN account_balances b ON b.account_id = a.id LEFT JOIN customer_holds c ON c.account_id = a.id
     WHERE a.id = ANY(p_account);
    IF cardinality(array_remove(p_limit, NULL)) > 0 THEN  -- some request names a limit
        PERFORM 1 FROM spend_limit_holds l WHERE l.limit_id = ANY(p_limit) ORDER BY l.limit_id FOR UPDATE;
        SELECT array_agg(l.limit_id ORDER BY l.limit_id),
               array_agg(l.limit_nano_usd - u.spent_nano_usd - (l.holds_placed_nano_usd - u.holds_closed_nano_usd) ORDER BY l.limit_id)
          INTO lim_ids, lim_available
          FROM spend_limit_holds l JOIN spend_limit_usage u ON u.limit_id = l.limit_id
         WHERE l.limit_id = ANY(p_limit);
    END IF;
    acc_wanted := ARRAY(SELECT coalesce(sum(r.amount), 0)::bigint FROM unnest(acc_ids) WITH ORDINALITY AS a(id, pos)
                          LEFT JOIN unnest(p_account, p_amount) AS r(account_id, amount) ON r.account_id = a.id
                         GROUP BY a.pos ORDER BY a.pos);
    lim_wanted := ARRAY(SELECT coalesce(sum(r.amount), 0)::bigint FROM unnest(lim_ids) WITH ORDINALITY AS l(id, pos)
                          LEFT JOIN unnest(p_limit, p_amount) AS r(limit_id, amount) ON r.limit_id = l.id
                         GROUP BY l.pos ORDER BY l.pos);
    -- Every account found and a customer's, every limit found, and each customer and
    -- limit covers the sum of its requests: unless a key was placed before, every
    -- request gets what it asked for.
    IF coalesce(cardinality(acc_ids), 0) = (SELECT count(DISTINCT x.id) FROM unnest(p_account) AS x(id))
       AND coalesce(cardinality(lim_ids), 0) = (SELECT count(DISTINCT x.id) FROM unnest(p_limit) AS x(id))
       AND NOT EXISTS (SELECT 1 FROM unnest(acc_kinds, acc_available, acc_wanted) AS a(kind, available, wanted)
                        WHERE a.kind <> 'customer' OR a.available < a.wanted)
       AND NOT EXISTS (SELECT 1 FROM unnest(lim_available, lim_wanted) AS l(available, wanted) WHERE l.available < l.wanted) THEN
        new_ids := ARRAY(SELECT nextval('holds_id_seq') FROM generate_series(1, n));
        BEGIN
            INSERT INTO holds (id, account_id, amount_nano_usd, idempotency_key, created_at, expires_at, spend_limit_id, replica_id)
            SELECT r.id, r.account_id, r.amount, r.key, p_now, p_now + make_interval(secs => r.ttl_s), r.limit_id, r.replica_id
              FROM unnest(new_ids, p_account, p_amount, p_key, p_ttl_s, p_limit, p_replica)
                   AS r(id, account_id, amount, key, ttl_s, limit_id, replica_id);
        EXCEPTION WHEN unique_violation THEN
            new_ids := NULL;  -- the insert is undone: the keys are read and each request decided
        END;
    END IF;
    IF new_ids IS NOT NULL THEN
        acc_placed := acc_wanted;
        lim_placed := lim_wanted;
        RETURN QUERY
        SELECT (r.pos - 1)::int, 'created'::text, r.id, r.amount, p_now + make_interval(secs => r.ttl_s), NULL::text
          FROM unnest(new_ids, p_amount, p_ttl_s) WITH ORDINALITY AS r(id, amount, ttl_s, pos);
    ELSE
    SELECT array_agg(h.idempotency_key), array_agg(h.account_id), array_agg(h.amount_nano_usd), array_agg(h.id),
           array_agg(h.expires_at), array_agg(h.spend_limit_id)
      INTO ex_keys, ex_accounts, ex_amounts, ex_ids, ex_expires, ex_limits
      FROM holds h WHERE h.idempotency_key = ANY(p_key);
    acc_placed := array_fill(0::bigint, ARRAY[coalesce(cardinality(acc_ids), 0)]);
    lim_placed := array_fill(0::bigint, ARRAY[coalesce(cardinality(lim_ids), 0)]);
""" + _decided_one_by_one() + """    END IF;
    UPDATE customer_holds c SET holds_placed_nano_usd = c.holds_placed_nano_usd + u.placed
      FROM unnest(acc_ids, acc_placed) AS u(account_id, placed)
     WHERE c.account_id = u.account_id AND u.placed <> 0;
    UPDATE spend_limit_holds l SET holds_placed_nano_usd = l.holds_placed_nano_usd + u.placed
      FROM unnest(lim_ids, lim_placed) AS u(limit_id, placed)
     WHERE l.limit_id = u.limit_id AND u.placed <> 0;
END $$
"""


# CREATE OR REPLACE drops them: 0028's, back (the search path is put back after every migration).
FUNCTION_SETTINGS = [f"ALTER FUNCTION {SIGNATURE} SET plan_cache_mode = force_generic_plan",
                     f"ALTER FUNCTION {SIGNATURE} SET enable_seqscan = off"]


def function_of_0028() -> list[str]:
    """The statements that put 0028's function back."""
    return [earlier_revision("0028_holds_granted_in_full_without_a_loop.py").place_holds_function(), *FUNCTION_SETTINGS]


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in (PLACE_HOLDS, *FUNCTION_SETTINGS):
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in function_of_0028():
            op.execute(statement)
