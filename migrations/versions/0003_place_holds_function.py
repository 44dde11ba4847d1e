"""Placing holds in one statement on PostgreSQL.

A hold is on the path to every request's first token. As one function call,
the whole batch (key lookups, the per-customer lock, the balance check, the
inserts and the counters) is one round trip, committed without waiting for
the flush. It implements exactly the rules of `ledger.holds.place_holds`,
which SQLite runs in Python; the shared test suite runs both. The caller
sends each key once (repeats inside a batch are answered in Python), so the
loop is linear in the batch: per-customer state lives in arrays.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

PLACE_HOLDS = """
CREATE FUNCTION paralon_place_holds(
    p_account bigint[], p_amount bigint[], p_minimum bigint[], p_key text[], p_ttl_s int[], p_now timestamptz
) RETURNS TABLE (idx int, status text, hold_id bigint, amount_nano_usd bigint, expires_at timestamptz, error_code text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    n int := coalesce(cardinality(p_key), 0);
    -- Active holds already stored under these keys (the caller sends each key once).
    ex_keys text[]; ex_accounts bigint[]; ex_amounts bigint[]; ex_ids bigint[]; ex_expires timestamptz[];
    -- Per customer, by position in acc_ids: kind, what is available, what this batch placed.
    acc_ids bigint[]; acc_kinds text[]; acc_available bigint[]; acc_placed bigint[];
    -- The decision for each request.
    r_status text[] := array_fill(NULL::text, ARRAY[n]);
    r_hold bigint[] := array_fill(NULL::bigint, ARRAY[n]);
    r_amount bigint[] := array_fill(NULL::bigint, ARRAY[n]);
    r_expires timestamptz[] := array_fill(NULL::timestamptz, ARRAY[n]);
    r_error text[] := array_fill(NULL::text, ARRAY[n]);
    e int; j int; want bigint; lowest bigint; granted bigint;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT array_agg(h.idempotency_key), array_agg(h.account_id), array_agg(h.amount_nano_usd), array_agg(h.id), array_agg(h.expires_at)
      INTO ex_keys, ex_accounts, ex_amounts, ex_ids, ex_expires
      FROM holds h WHERE h.idempotency_key = ANY(p_key);
    PERFORM 1 FROM customer_holds c WHERE c.account_id = ANY(p_account) ORDER BY c.account_id FOR UPDATE;
    SELECT array_agg(a.id ORDER BY a.id), array_agg(a.kind ORDER BY a.id),
           array_agg(b.balance_nano_usd - (coalesce(c.holds_placed_nano_usd, 0) - b.holds_closed_nano_usd) ORDER BY a.id)
      INTO acc_ids, acc_kinds, acc_available
      FROM accounts a JOIN account_balances b ON b.account_id = a.id LEFT JOIN customer_holds c ON c.account_id = a.id
     WHERE a.id = ANY(p_account);
    acc_placed := array_fill(0::bigint, ARRAY[coalesce(cardinality(acc_ids), 0)]);
    FOR i IN 1 .. n LOOP
        want := p_amount[i];
        lowest := coalesce(p_minimum[i], want);
        e := array_position(ex_keys, p_key[i]);
        j := array_position(acc_ids, p_account[i]);
        IF e IS NOT NULL THEN
            IF ex_accounts[e] = p_account[i] AND ex_amounts[e] BETWEEN lowest AND want THEN
                r_status[i] := 'exists'; r_hold[i] := ex_ids[e]; r_amount[i] := ex_amounts[e]; r_expires[i] := ex_expires[e];
            ELSE
                r_error[i] := 'exists_with_different_content';
            END IF;
        ELSIF j IS NULL THEN
            r_error[i] := 'unknown_account';
        ELSIF acc_kinds[j] <> 'customer' THEN
            r_error[i] := 'wrong_account_kind';
        ELSE
            granted := least(want, acc_available[j]);
            IF granted < lowest THEN
                r_error[i] := 'overdraft'; r_amount[i] := acc_available[j];
            ELSE
                acc_available[j] := acc_available[j] - granted;
                acc_placed[j] := acc_placed[j] + granted;
                r_status[i] := 'created'; r_amount[i] := granted; r_expires[i] := p_now + make_interval(secs => p_ttl_s[i]);
            END IF;
        END IF;
    END LOOP;
    RETURN QUERY
    WITH inserted AS (
        INSERT INTO holds (account_id, amount_nano_usd, idempotency_key, created_at, expires_at)
        SELECT p_account[i], r_amount[i], p_key[i], p_now, r_expires[i]
          FROM generate_subscripts(p_key, 1) AS i WHERE r_status[i] = 'created'
        RETURNING holds.id, holds.idempotency_key
    )
    SELECT (i - 1)::int, r_status[i], coalesce(r_hold[i], inserted.id), r_amount[i], r_expires[i], r_error[i]
      FROM generate_subscripts(p_key, 1) AS i LEFT JOIN inserted ON inserted.idempotency_key = p_key[i];
    UPDATE customer_holds c SET holds_placed_nano_usd = c.holds_placed_nano_usd + u.placed
      FROM unnest(acc_ids, acc_placed) AS u(account_id, placed)
     WHERE c.account_id = u.account_id AND u.placed <> 0;
END $$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PLACE_HOLDS)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION paralon_place_holds(bigint[], bigint[], bigint[], text[], int[], timestamptz)")
