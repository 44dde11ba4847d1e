"""Placing holds in one statement on PostgreSQL.

A hold is on the path to every request's first token. As one function call,
the whole batch (key lookups, the per-customer lock, the balance check, the
inserts and the counters) is one round trip, committed without waiting for
the flush. It implements exactly the rules of `ledger.holds.place_holds`,
which SQLite runs in Python; the shared test suite runs both.

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
    existing jsonb;       -- key -> the active hold stored under it
    books jsonb;          -- account -> kind and available nano-USD
    seen jsonb := '{}';   -- key -> the hold placed for it earlier in this batch
    placed jsonb := '{}'; -- account -> nano-USD placed by this batch
    acc bigint; want bigint; lowest bigint; available bigint; granted bigint; held jsonb; k text; due timestamptz;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT coalesce(jsonb_object_agg(h.idempotency_key, jsonb_build_object(
               'account', h.account_id, 'amount', h.amount_nano_usd, 'id', h.id, 'expires', h.expires_at)), '{}')
      INTO existing FROM holds h WHERE h.idempotency_key = ANY(p_key);
    PERFORM 1 FROM customer_holds c WHERE c.account_id = ANY(p_account) ORDER BY c.account_id FOR UPDATE;
    SELECT coalesce(jsonb_object_agg(a.id::text, jsonb_build_object('kind', a.kind, 'available',
               b.balance_nano_usd - (coalesce(c.holds_placed_nano_usd, 0) - b.holds_closed_nano_usd))), '{}')
      INTO books
      FROM accounts a JOIN account_balances b ON b.account_id = a.id LEFT JOIN customer_holds c ON c.account_id = a.id
     WHERE a.id = ANY(p_account);
    FOR i IN 1 .. coalesce(cardinality(p_account), 0) LOOP
        idx := i - 1; status := NULL; hold_id := NULL; amount_nano_usd := NULL; expires_at := NULL; error_code := NULL;
        acc := p_account[i]; want := p_amount[i]; k := p_key[i]; lowest := coalesce(p_minimum[i], want);
        IF existing ? k THEN
            held := existing -> k;
            IF (held->>'account')::bigint = acc AND (held->>'amount')::bigint BETWEEN lowest AND want THEN
                status := 'exists'; hold_id := (held->>'id')::bigint; amount_nano_usd := (held->>'amount')::bigint;
                expires_at := (held->>'expires')::timestamptz;
            ELSE
                error_code := 'exists_with_different_content';
            END IF;
        ELSIF seen ? k THEN
            held := seen -> k;
            IF (held->>'account')::bigint = acc AND (held->>'want')::bigint = want
               AND (held->'minimum') = coalesce(to_jsonb(p_minimum[i]), 'null'::jsonb) THEN
                status := 'exists'; hold_id := (held->>'id')::bigint; amount_nano_usd := (held->>'amount')::bigint;
                expires_at := (held->>'expires')::timestamptz;
            ELSE
                error_code := 'exists_with_different_content';
            END IF;
        ELSIF NOT books ? acc::text THEN
            error_code := 'unknown_account';
        ELSIF books -> acc::text ->> 'kind' <> 'customer' THEN
            error_code := 'wrong_account_kind';
        ELSE
            available := (books -> acc::text ->> 'available')::bigint;
            granted := least(want, available);
            IF granted < lowest THEN
                error_code := 'overdraft'; amount_nano_usd := available;
            ELSE
                due := p_now + make_interval(secs => p_ttl_s[i]);
                INSERT INTO holds (account_id, amount_nano_usd, idempotency_key, created_at, expires_at)
                VALUES (acc, granted, k, p_now, due) RETURNING id INTO hold_id;
                books := jsonb_set(books, ARRAY[acc::text, 'available'], to_jsonb(available - granted));
                placed := jsonb_set(placed, ARRAY[acc::text], to_jsonb(coalesce((placed ->> acc::text)::bigint, 0) + granted));
                seen := seen || jsonb_build_object(k, jsonb_build_object('account', acc, 'want', want,
                            'minimum', p_minimum[i], 'id', hold_id, 'amount', granted, 'expires', due));
                status := 'created'; amount_nano_usd := granted; expires_at := due;
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
    UPDATE customer_holds c SET holds_placed_nano_usd = c.holds_placed_nano_usd + v.value::bigint
      FROM jsonb_each_text(placed) v WHERE c.account_id = v.key::bigint;
END $$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PLACE_HOLDS)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION paralon_place_holds(bigint[], bigint[], bigint[], text[], int[], timestamptz)")
