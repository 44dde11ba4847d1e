"""What keeping an event's postings in its own row would save, before building it.

Today each settlement writes one `ledger_events` row and three `ledger_postings`
rows (six index entries). The alternative keeps the postings as two arrays
(accounts, amounts) in the event's row, its zero sum a CHECK. This writes the
same settlements both ways, batch after batch in one run, into scratch tables
shaped like the ledger's (keys, digests, hashes, a canonical payload), and
reads the server's own time and WAL for each statement from
EXPLAIN (ANALYZE, WAL). The zero-sum CHECK is measured three ways: none, a
PL/pgSQL loop, a SQL aggregate. No guard triggers run in either layout, so
the ratios compare the rows alone.

    python benchmarks/postings_layout.py --database-url postgresql://postgres@127.0.0.1:5432/postgres --json

The database in the URL is only used to create (and finally drop) a scratch
database of the benchmark's own.
"""
from __future__ import annotations

import hashlib
import statistics
import sys
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger.storage.pg_arrays import bytea_array, ints, nullable_ints, texts, words  # noqa: E402
from scratch import ScratchDatabase, batch_arguments, log, modify_table_nodes, print_result  # noqa: E402

US_PER_MS = 1000
EVENT_COLUMNS = """seq bigint PRIMARY KEY, event_type varchar(64) NOT NULL, payload text NOT NULL,
    idempotency_key varchar(200) NOT NULL UNIQUE, content_digest bytea NOT NULL, reverses_seq bigint,
    recorded_at timestamptz NOT NULL, prev_hash bytea NOT NULL, hash bytea NOT NULL"""
ZERO_SUM_CHECKS = {
    "none": None,
    "plpgsql_loop": """CREATE FUNCTION {name}(a bigint[]) RETURNS boolean IMMUTABLE LANGUAGE plpgsql AS $$
        DECLARE total bigint := 0; x bigint; BEGIN FOREACH x IN ARRAY a LOOP total := total + x; END LOOP; RETURN total = 0; END $$""",
    "sql_aggregate": "CREATE FUNCTION {name}(bigint[]) RETURNS boolean IMMUTABLE LANGUAGE sql AS 'SELECT coalesce(sum(x), 0) = 0 FROM unnest($1) x'",
}
_EVENT_ARRAYS = "unnest(%(seq)s::bigint[], %(type)s::text[], %(payload)s::text[], %(key)s::text[], %(digest)s::bytea[], %(reverses)s::bigint[], %(hash)s::bytea[])"
POSTING_ROWS = f"""EXPLAIN (ANALYZE, WAL, FORMAT JSON)
WITH events AS (
    INSERT INTO events_beside_postings
    SELECT u.seq, u.type, u.payload, u.key, u.digest, u.reverses, now(), u.hash, u.hash
    FROM {_EVENT_ARRAYS} AS u(seq, type, payload, key, digest, reverses, hash)
)
INSERT INTO postings SELECT * FROM unnest(%(posting_seq)s::bigint[], %(leg)s::int[], %(account)s::bigint[], %(amount)s::bigint[])"""
POSTING_ARRAYS = """EXPLAIN (ANALYZE, WAL, FORMAT JSON)
INSERT INTO {table}
SELECT u.seq, u.type, u.payload, u.key, u.digest, u.reverses, now(), u.hash, u.hash,
       ARRAY[u.customer, u.owner, u.platform], ARRAY[-u.charge, u.charge - u.charge / 5, u.charge / 5]
FROM unnest(%(seq)s::bigint[], %(type)s::text[], %(payload)s::text[], %(key)s::text[], %(digest)s::bytea[], %(reverses)s::bigint[],
            %(hash)s::bytea[], %(customer)s::bigint[], %(owner)s::bigint[], %(platform)s::bigint[], %(charge)s::bigint[])
     AS u(seq, type, payload, key, digest, reverses, hash, customer, owner, platform, charge)"""
PAYLOAD = ('{{"charge_nano_usd":{charge},"customer_account_id":{customer},"hold_id":{seq},"meta":{{"model":"bench","prompt_tokens":950}},'
           '"owner_account_id":{owner},"owner_nano_usd":{owner_share},"platform_nano_usd":{platform_share},'
           '"released_nano_usd":{released},"request_id":"req:{seq}"}}')


def create_tables(conn) -> list[str]:
    """The rows layout, and one arrays table per zero-sum check; returns the layouts' names."""
    conn.execute(f"CREATE TABLE events_beside_postings ({EVENT_COLUMNS})")
    conn.execute("CREATE TABLE postings (event_seq bigint, leg int, account_id bigint NOT NULL, amount_nano_usd bigint NOT NULL, "
                 "PRIMARY KEY (event_seq, leg))")
    conn.execute("CREATE INDEX ON postings (account_id, event_seq)")  # the balance guard's index
    layouts = ["rows"]
    for check, function in ZERO_SUM_CHECKS.items():
        constraint = "CHECK (cardinality(posting_accounts) = cardinality(posting_amounts))"
        if function is not None:
            conn.execute(function.format(name=f"sums_to_zero_{check}"))
            constraint = constraint[:-1] + f" AND sums_to_zero_{check}(posting_amounts))"
        conn.execute(f"CREATE TABLE events_with_postings_{check} ({EVENT_COLUMNS}, posting_accounts bigint[] NOT NULL, "
                     f"posting_amounts bigint[] NOT NULL, {constraint})")
        layouts.append(f"arrays_{check}")
    return layouts


def batch_params(first_seq: int, size: int) -> tuple[dict, dict]:
    """The same settlements, as the rows layout and the arrays layout take them."""
    seqs = range(first_seq, first_seq + size)
    customers, owners, charges = [10 + s % 64 for s in seqs], [80 + s % 8 for s in seqs], [150 * (900 + s % 97) for s in seqs]
    payloads = [PAYLOAD.format(seq=s, charge=c, customer=cu, owner=o, owner_share=c - c // 5, platform_share=c // 5, released=5_000_000 - c)
                for s, c, cu, o in zip(seqs, charges, customers, owners)]
    event = {"seq": ints(seqs), "type": words(["RequestSettled"] * size), "payload": texts(payloads),
             "key": texts([f"s:{s}" for s in seqs]), "digest": bytea_array([hashlib.sha256(b"d%d" % s).digest() for s in seqs]),
             "reverses": nullable_ints([None] * size), "hash": bytea_array([hashlib.sha256(b"h%d" % s).digest() for s in seqs])}
    legs = [(s, leg, account, amount) for s, cu, o, c in zip(seqs, customers, owners, charges)
            for leg, (account, amount) in enumerate(((cu, -c), (o, c - c // 5), (1, c // 5)))]
    rows = {**event, **{name: ints(column) for name, column in zip(("posting_seq", "leg", "account", "amount"), zip(*legs))}}
    arrays = {**event, "customer": ints(customers), "owner": ints(owners), "platform": ints([1] * size), "charge": ints(charges)}
    return rows, arrays


def time_and_wal(plan: dict, size: int) -> tuple[float, float]:
    """Server µs and WAL bytes per settlement of every insert in the statement."""
    wal = sum(node.get("WAL Bytes", 0) for node in modify_table_nodes(plan))
    return plan["Execution Time"] * US_PER_MS / size, wal / size


def measure(url: str, batches: int, batch_size: int, warm_up_batches: int) -> dict:
    with psycopg.connect(url, autocommit=True) as conn:
        layouts = create_tables(conn)
        samples: dict[str, list[tuple[float, float]]] = {layout: [] for layout in layouts}
        for b in range(warm_up_batches + batches):
            rows, arrays = batch_params(b * batch_size + 1, batch_size)
            for layout in layouts:
                sql = POSTING_ROWS if layout == "rows" else POSTING_ARRAYS.format(table=f"events_with_postings_{layout[len('arrays_'):]}")
                plan = conn.execute(sql, rows if layout == "rows" else arrays).fetchone()[0][0]
                if b >= warm_up_batches:
                    samples[layout].append(time_and_wal(plan, batch_size))
            log(f"batch {b + 1}/{warm_up_batches + batches}")
    medians = {layout: (statistics.median(t for t, _ in s), statistics.median(w for _, w in s)) for layout, s in samples.items()}
    base_us, base_wal = medians["rows"]
    return {
        "settlements_per_batch": batch_size,
        "batches": batches,
        "by_layout": {layout: {"server_us_per_settlement": round(us, 2), "wal_bytes_per_settlement": round(wal, 1),
                               "time_ratio_to_rows": round(us / base_us, 3), "wal_ratio_to_rows": round(wal / base_wal, 3)}
                      for layout, (us, wal) in medians.items()},
    }


def main() -> None:
    args = batch_arguments(__doc__.split("\n\n")[0], batches=40)
    with ScratchDatabase(args.database_url, "paralon_postings_layout") as scratch:
        if scratch.sqlite:
            raise SystemExit("the layouts are PostgreSQL's: give a postgresql:// URL")
        url = scratch.url.set(drivername="postgresql").render_as_string(hide_password=False)
        result = measure(url, args.batches, args.batch_size, args.warm_up_batches)
    print_result(result, args.json)


if __name__ == "__main__":
    main()
