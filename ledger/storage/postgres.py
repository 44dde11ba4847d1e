"""PostgreSQL: set-based statements, one round trip where the rules allow it.

Each statement takes a whole batch as arrays (`unnest` of one literal per
column, `ledger.storage.pg_arrays`), and an append's events and postings go in
by COPY, so a batch of a thousand settlements is a handful of statements;
statements that return a row per batch item run on the raw psycopg cursor,
whose plain tuples cost less than SQLAlchemy's rows.
"""
from __future__ import annotations

from datetime import datetime, timedelta

import psycopg
from psycopg import ClientCursor
from sqlalchemy import Connection, Engine, String, any_, bindparam, cast, create_engine, event
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from ledger.errors import BadDatabaseUrl, FlushNotConfirmed, InvariantBroken, LedgerError
from ledger.limits import (
    DATABASE_CONNECT_TIMEOUT_S,
    DATABASE_KEEPALIVE_IDLE_S,
    DATABASE_KEEPALIVE_INTERVAL_S,
    DATABASE_KEEPALIVE_PROBES,
    DATABASE_TCP_USER_TIMEOUT_MS,
    EVENTS_INSERTED_WITH_COMMIT_MAX,
    STATEMENT_EXECUTIONS_BEFORE_PREPARED,
)
from ledger.hold_commands import HoldRenewal, HoldResult, PlaceHold, hold_result_of, place_each_key_once, refusal
from ledger.money import SETTLEMENT_LEGS
from ledger.schema import utc_now
from ledger.storage.base import (
    LOOK_UP_EVERY_KEY,
    NEW_HOLD_COLUMNS,
    POSTINGS_IN_EVENT_ROW_SEEN,
    STORED_EVENT_COLUMNS,
    AppendedBatch,
    ClosedHold,
    HeadRead,
    HoldRules,
    KnownKeys,
    Storage,
    closed_hold_of,
)
from ledger.storage.pg_arrays import ints, nullable_ints, nullable_texts, texts
from ledger.storage.pg_literals import statements_text

# How a batch of new holds travels: one array literal per column, in the
# column order of ledger.storage.base.
_NEW_HOLD_ARRAYS = dict(zip(NEW_HOLD_COLUMNS, (ints, ints, texts, ints, nullable_ints, nullable_texts)))

# Connection exceptions (class 08), and the server shutting a session down
# (an administrator's pg_terminate_backend, a crash, a server still starting).
_CONNECTION_SQLSTATE_CLASS = "08"
_SESSION_ENDED_SQLSTATES = ("57P01", "57P02", "57P03")

_SESSION_IN_UTC = "-c TimeZone=UTC"

# Serialisation failure, deadlock, unique violation.
_RETRYABLE_SQLSTATES = ("40001", "40P01", "23505")

# A commit waits for the flush only if its transaction wrote WAL and took a
# transaction id: a transactional logical message does both (a bare
# pg_current_xact_id() writes nothing, and its commit does not wait). It
# waits even where the server, the database or the role turned
# synchronous_commit off (then for the local flush); any other setting is
# kept, a synchronous standby's wait included.
_FLUSH_BARRIER = (
    "SELECT pg_logical_emit_message(true, 'paralon-flush', '') FROM (SELECT set_config('synchronous_commit', "
    "CASE current_setting('synchronous_commit') WHEN 'off' THEN 'local' ELSE current_setting('synchronous_commit') END, true)) AS s"
)

_LOCK_HEAD = "SELECT last_seq, last_hash, postings_in_event_row FROM ledger_head WHERE id = 1 FOR UPDATE"
_KNOWN_KEYS = ("SELECT idempotency_key, content_digest, seq, event_type FROM ledger_events "
               "WHERE idempotency_key = ANY(%(keys)s::text[])")
# A page of the log on the raw cursor: psycopg's own loaders give UTC-aware
# times (the column is timestamptz) and plain tuples, without a Python
# conversion per row; a replay reads a million of them.
_LOG_EVENTS = f"SELECT {', '.join(STORED_EVENT_COLUMNS)} FROM ledger_events WHERE seq > %(after)s ORDER BY seq LIMIT %(limit)s"
_LOG_POSTINGS = ("SELECT event_seq, account_id, amount_nano_usd FROM ledger_event_postings "
                 "WHERE event_seq BETWEEN %(first)s AND %(last)s ORDER BY event_seq, leg")
_BALANCES = "SELECT account_id, balance_nano_usd FROM account_balances WHERE account_id = ANY(%(ids)s::bigint[])"

# An append's events and postings go in by COPY: the server then writes a
# page's worth of heap rows per WAL record (a multi-insert), where INSERT ...
# SELECT writes one record per row; measured, 195 B of WAL less per settlement
# (1,790 B before) and less of the server's CPU. The guards still fire: a
# statement trigger sees a COPY's rows as it sees an INSERT's.
_COPY_EVENTS = ("COPY ledger_events (seq, event_type, payload, idempotency_key, content_digest, reverses_seq, prev_hash, hash, "
                "recorded_at) FROM STDIN")
_COPY_POSTINGS = "COPY ledger_postings (event_seq, leg, account_id, amount_nano_usd) FROM STDIN"
# Postings in their event's row (migration 0031): two array columns more, no posting rows.
_COPY_EVENTS_WITH_POSTINGS = _COPY_EVENTS.replace("recorded_at)", "recorded_at, posting_account_ids, posting_amounts_nano_usd)")
# COPY's text format: these four characters are escaped, NULL is \N.
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
_COPY_NULL = "\\N"
_COPY_BYTEA_HEX = "\\\\x"  # bytea's hex form starts \x; its backslash escaped for COPY

# What an append writes after its rows, as one statement. The balances have
# moved already, and the holds the batch settled have closed: the events'
# COPY did both, in one update of each balance row (migrations 0030 and
# 0035). The head moves only if the balances are those the batch decided and
# the closes announced were taken; on a database without those migrations
# neither happens. Spend limits' usage is added to, not set: releases change
# it without the append lock. The check fails on the server, not by a count of
# rows the client reads: a head that may not move is set to NULL, which its
# NOT NULL refuses, so the statement can travel with the COMMIT after it
# (`commit_durable_batch`) and a refusal aborts the transaction before
# that COMMIT runs. The head row exists: this transaction's lock holds it.
_WRITE_APPENDED = """
UPDATE ledger_head SET last_hash = %(last_hash)s, last_seq = CASE
    WHEN coalesce(current_setting('paralon.holds_closed_account_ids', true), '') = '' AND NOT EXISTS (
        SELECT FROM unnest(%(balance_account_id)s::bigint[], %(balance)s::bigint[]) AS u(account_id, balance)
        LEFT JOIN account_balances b ON b.account_id = u.account_id
        WHERE b.balance_nano_usd IS DISTINCT FROM u.balance)
    THEN %(last_seq)s END
WHERE id = 1
"""
_HEAD_REFUSED = ("the postings did not move the balances to those the batch decided, or close the holds it settled: "
                 "run `paralon migrate` (migrations 0030 and 0035)")
_NOT_NULL_VIOLATION = "23502"
_UNIQUE_VIOLATION = "23505"
# The same, when the batch settled holds that reserve against spend limits.
_WRITE_APPENDED_WITH_LIMITS = """
WITH limits AS (
    UPDATE spend_limit_usage AS l
    SET spent_nano_usd = l.spent_nano_usd + u.spent, holds_closed_nano_usd = l.holds_closed_nano_usd + u.closed
    FROM unnest(%(limit_id)s::bigint[], %(limit_spent)s::bigint[], %(limit_closed)s::bigint[]) AS u(limit_id, spent, closed)
    WHERE l.limit_id = u.limit_id
)""" + _WRITE_APPENDED
# What a batch closes, announced before its events' COPY for the postings'
# trigger to add (migration 0035); transaction-local, and cleared by the trigger.
_ANNOUNCE_HOLDS_CLOSED = ("SELECT set_config('paralon.holds_closed_account_ids', %(ids)s, true), "
                          "set_config('paralon.holds_closed_nano_usd', %(amounts)s, true)")
# The connection's record of what its transaction announced (conn.info).
_HOLDS_CLOSED_ANNOUNCED = "paralon_holds_closed_announced"
# The transaction whose next statement on the raw cursor skips the flush wait
# (conn.info), and the statement that does: one with a row, as every statement
# sent together is read back (`_statements_rows`).
_FLUSH_WAIT_SKIP_PENDING = "paralon_flush_wait_skip_pending"
_SKIP_FLUSH_WAIT = "SELECT set_config('synchronous_commit', 'off', true)"
# The transaction whose writes wait to travel with its COMMIT (conn.info):
# the transaction, then the statements `write_appended` left for it (the
# head's move; a small batch's events too).
_CARRIED_TO_COMMIT = "paralon_carried_to_commit"
# The connection's own cursors (conn.info, which the pool clears when it
# replaces the connection it describes), one of each kind.
_OWN_CURSOR = "paralon_own_cursor"
_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK
# Up to EVENTS_INSERTED_WITH_COMMIT_MAX events, a batch whose head travels
# with its COMMIT inserts them in that same query, not by COPY, whose two
# round trips (its start, then its data and end) are a large part of what a
# batch of one or two costs (the proxy's, at a few settlements a
# millisecond). Larger batches keep COPY, which writes a page of rows per
# WAL record.
_INSERT_EVENTS = ("INSERT INTO ledger_events (seq, event_type, payload, idempotency_key, content_digest, reverses_seq, "
                  "prev_hash, hash, recorded_at) VALUES ")
_INSERT_EVENTS_WITH_POSTINGS = _INSERT_EVENTS.replace("recorded_at)", "recorded_at, posting_account_ids, posting_amounts_nano_usd)")
_INSERT_POSTINGS = "INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd) VALUES "
# The transaction whose BEGIN waits to travel with its first statement
# (conn.info), on a connection in autocommit: psycopg would send it alone.
_BEGIN_PENDING = "paralon_begin_pending"

# The hold rules, run by the server (migrations 0003, 0010 and 0015): one round trip
# on the path to every first token. It takes each key once.
# A hold created here expires at the `now` sent plus its ttl, which the
# caller adds itself: a timestamp parsed per hold cost more than the rest of its row.
_PLACE_HOLDS = (
    "SELECT idx, status, hold_id, amount_nano_usd, CASE WHEN status = 'created' THEN NULL ELSE expires_at END, error_code"
    " FROM paralon_place_holds("
    "%(account)s::bigint[], %(amount)s::bigint[], %(minimum)s::bigint[], %(key)s::text[], %(ttl_s)s::int[], "
    "%(spend_limit)s::bigint[], %(replica)s::text[], %(now)s)"
)
_INSERT_HOLDS = """
INSERT INTO holds (account_id, amount_nano_usd, idempotency_key, created_at, expires_at, spend_limit_id, replica_id)
SELECT u.account_id, u.amount, u.key, %(now)s, %(now)s + make_interval(secs => u.ttl_s), u.spend_limit_id, u.replica_id
FROM unnest(%(account_id)s::bigint[], %(amount_nano_usd)s::bigint[], %(idempotency_key)s::text[],
    %(ttl_s)s::int[], %(spend_limit_id)s::bigint[], %(replica_id)s::text[])
    AS u(account_id, amount, key, ttl_s, spend_limit_id, replica_id)
RETURNING id, idempotency_key
"""
_RENEW_HOLDS = """
UPDATE holds AS h
SET expires_at = %(now)s + make_interval(secs => u.ttl_s),
    capture_nano_usd = least(h.amount_nano_usd, greatest(h.capture_nano_usd, u.capture)),
    capture_owner_account_id = coalesce(u.owner, h.capture_owner_account_id),
    capture_request_id = coalesce(u.request_id, h.capture_request_id),
    capture_meta = coalesce(u.meta, h.capture_meta)
FROM unnest(%(id)s::bigint[], %(ttl_s)s::int[], %(capture)s::bigint[], %(owner)s::bigint[], %(request_id)s::text[],
            %(meta)s::text[]) AS u(id, ttl_s, capture, owner, request_id, meta)
WHERE h.id = u.id
RETURNING h.id
"""
# What a settlement reads of the holds it closes; no row to put back (NULL).
# A hold closed for a settlement that then fails (rare) is put back from its
# row as another connection still sees it: this transaction's delete is not
# committed, and its row lock keeps anyone else from changing the row. Each
# whole row's text in the RETURNING cost, measured on 512 holds a batch, 1.1
# µs of the server and 0.3 of the writer a hold (2.70 and 0.92 µs against
# 1.60 and 0.62).
_CLOSE_HOLDS = """
DELETE FROM holds WHERE id = ANY(%(id)s::bigint[])
RETURNING id, account_id, amount_nano_usd, spend_limit_id, NULL
"""
# Captures that are not final: each hold keeps the rest (a replica's pooled hold).
_TAKE_FROM_HOLDS = """
UPDATE holds AS h SET amount_nano_usd = h.amount_nano_usd - t.amount
FROM unnest(%(id)s::bigint[], %(amount)s::bigint[]) AS t(id, amount)
WHERE h.id = t.id AND h.amount_nano_usd >= t.amount
RETURNING h.id, h.account_id, t.amount, h.spend_limit_id, NULL
"""
_GIVE_BACK_TO_HOLDS = """
UPDATE holds AS h SET amount_nano_usd = h.amount_nano_usd + t.amount
FROM unnest(%(id)s::bigint[], %(amount)s::bigint[]) AS t(id, amount)
WHERE h.id = t.id
"""
_HOLD_ROWS = "SELECT holds::text FROM holds WHERE id = ANY(%(id)s::bigint[])"
_REOPEN_HOLDS = "INSERT INTO holds SELECT * FROM unnest(%(row)s::text[]::holds[])"
_ADD_PLACED = """
UPDATE customer_holds AS c SET holds_placed_nano_usd = c.holds_placed_nano_usd + u.amount
FROM unnest(%(id)s::bigint[], %(amount)s::bigint[]) AS u(id, amount)
WHERE c.account_id = u.id
"""
_ADD_CLOSED = """
UPDATE account_balances AS b SET holds_closed_nano_usd = b.holds_closed_nano_usd + u.amount
FROM unnest(%(id)s::bigint[], %(amount)s::bigint[]) AS u(id, amount)
WHERE b.account_id = u.id
"""
_ADD_LIMIT_PLACED = """
UPDATE spend_limit_holds AS l SET holds_placed_nano_usd = l.holds_placed_nano_usd + u.amount
FROM unnest(%(id)s::bigint[], %(amount)s::bigint[]) AS u(id, amount) WHERE l.limit_id = u.id
"""
_ADD_LIMIT_USAGE = """
UPDATE spend_limit_usage AS l
SET spent_nano_usd = l.spent_nano_usd + u.spent, holds_closed_nano_usd = l.holds_closed_nano_usd + u.closed
FROM unnest(%(limit_id)s::bigint[], %(spent)s::bigint[], %(closed)s::bigint[]) AS u(limit_id, spent, closed)
WHERE l.limit_id = u.limit_id
"""


class PostgresStorage(Storage):
    dialect = "postgresql"
    url_backends = ("postgresql", "postgres")
    holds_in_one_statement = True
    postings_in_event_row_possible = True
    durable_batches_in_autocommit = True  # psycopg sends a BEGIN alone, a round trip: the storage sends its own
    # OperationalError: refused, dropped, terminated by an administrator, timed out;
    # InterfaceError: used after it closed.
    driver_connection_errors = (psycopg.OperationalError, psycopg.InterfaceError)

    def engine_url(self, url: URL) -> URL:
        if not url.database:
            raise BadDatabaseUrl(f"database URL {url.render_as_string(hide_password=True)!r} names no database")
        return url.set(drivername="postgresql+psycopg")

    def snapshot_connection(self, engine: Engine) -> Connection:
        return engine.connect().execution_options(isolation_level="REPEATABLE READ")  # one snapshot per transaction

    def create_engine(self, url: URL, *, pool_size: int) -> Engine:
        # No server-side prepared statements but one: batch statements take arrays
        # whose length varies, and a generic plan (estimated for ten elements, on
        # whatever statistics were current) can turn a thousand-row join quadratic.
        # Planning each batch statement afresh costs microseconds per batch. The
        # hold function's call is asked to be prepared (`_call_place_holds`): its
        # plan is a function scan whatever the batch, and a call is often of one
        # hold, whose parse and plan took a fifth of the server's time for it.
        # Sessions speak UTC whatever the server's default: times come back as
        # UTC (psycopg then gives datetime.UTC itself) and days are UTC days.
        # A pooled connection is pinged before it is handed out (one that died is
        # replaced); a connection attempt and a dead path are noticed in seconds.
        engine = create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True,
                               connect_args={"prepare_threshold": STATEMENT_EXECUTIONS_BEFORE_PREPARED, "connect_timeout": DATABASE_CONNECT_TIMEOUT_S,
                                             "options": _SESSION_IN_UTC,
                                             "keepalives": 1, "keepalives_idle": DATABASE_KEEPALIVE_IDLE_S,
                                             "keepalives_interval": DATABASE_KEEPALIVE_INTERVAL_S,
                                             "keepalives_count": DATABASE_KEEPALIVE_PROBES,
                                             "tcp_user_timeout": DATABASE_TCP_USER_TIMEOUT_MS})
        event.listen(engine, "before_cursor_execute", _begin_before_statement)
        return engine

    def skip_flush_wait(self, conn: Connection, *, with_next_statement: bool = False) -> None:
        """In pipeline mode: at a transaction's start, its BEGIN and the SET
        travel together, one round trip where there were two; or, with the
        next statements on the raw cursor (`_rows`, `_statements_rows`), in
        their round trip."""
        if with_next_statement:
            conn.info[_FLUSH_WAIT_SKIP_PENDING] = conn.get_transaction()
            return
        raw = conn.connection.driver_connection
        with raw.pipeline():
            raw.execute("SET LOCAL synchronous_commit = off")

    def begin_durable_batch(self, conn: Connection) -> None:
        """Nothing is sent: the BEGIN and the skip of the flush wait go with
        the transaction's first statement, on the raw cursor (`_rows`,
        `_statements_rows`) or, through SQLAlchemy, just before it
        (`_begin_before_statement`); the head's move goes with the COMMIT."""
        transaction = conn.get_transaction()
        if conn.connection.driver_connection.autocommit:
            conn.info[_BEGIN_PENDING] = transaction
        self.skip_flush_wait(conn, with_next_statement=True)
        conn.info[_CARRIED_TO_COMMIT] = (transaction, [])

    def commit_durable_batch(self, conn: Connection, *, wait_for_flush: bool) -> None:
        """One query of the simple protocol, one round trip: the skip of the
        flush wait if no statement carried it yet, what the appends kept for
        it (a small batch's events, the head's move), COMMIT, and with
        `wait_for_flush` the flush barrier, which runs after the COMMIT as a
        transaction of its own. The server stops at the first error: in the
        transaction, nothing committed (the connection is left in the failed
        transaction, for the caller's rollback); after it, the transaction
        committed and only its flush is not known (FlushNotConfirmed)."""
        carried = _take_carried(conn)
        conn.info.pop(_CARRIED_TO_COMMIT, None)
        if _pending(conn, _BEGIN_PENDING):  # no statement ran: nothing to commit, only earlier commits to wait for
            conn.info.pop(_FLUSH_WAIT_SKIP_PENDING, None)
            statements = []
        else:
            statements = [*_opening(conn), *carried, ("COMMIT", None)]
        if wait_for_flush:
            statements.append((_FLUSH_BARRIER, None))
        if not statements:
            return
        raw = conn.connection.driver_connection
        query = statements_text(statements)
        try:
            _own_cursor(conn).execute(query)
        except psycopg.Error as exc:
            if raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE or self.is_connection_error(exc):
                _note_keys_refused(conn, exc)
                _raise_head_refused_or(exc, query)
            raise FlushNotConfirmed() from exc

    def wait_for_flush(self, conn: Connection) -> None:
        """One transaction of its own that writes a WAL record and waits for
        its flush, which flushes every commit before it in the WAL too."""
        raw = conn.connection.driver_connection
        raw.autocommit = True  # the statement is the transaction: one round trip
        try:
            raw.execute(_FLUSH_BARRIER)
        finally:
            if not raw.closed:
                raw.autocommit = False

    def is_retryable_error(self, error: BaseException | None) -> bool:
        return getattr(error, "sqlstate", None) in _RETRYABLE_SQLSTATES

    def is_connection_error(self, error: BaseException | None) -> bool:
        if not isinstance(error, self.driver_connection_errors):
            return False
        sqlstate = getattr(error, "sqlstate", None)  # none: the client found the connection gone
        return sqlstate is None or sqlstate.startswith(_CONNECTION_SQLSTATE_CLASS) or sqlstate in _SESSION_ENDED_SQLSTATES

    def one_of(self, column, values: list):
        """One array parameter (`= ANY`), so the statement text, and every cache
        keyed on it, is the same for any batch size."""
        literal = texts(values) if values and isinstance(values[0], str) else ints(values)
        return column == any_(cast(bindparam(None, literal, type_=String), ARRAY(column.type)))

    def read_known_keys(self, conn: Connection, keys: list[str]) -> KnownKeys:
        """The statement the append lock's read runs: its array is a typed literal,
        a constant to the planner, which probes the unique index or hashes the
        keys. (`one_of`'s cast of a text parameter is evaluated per row: on a
        log of tens of thousands of events the planner chose a scan comparing
        every row with every key, seconds for a batch of a thousand.)"""
        return {r[0]: (r[1], r[2], r[3]) for r in _rows(conn, _KNOWN_KEYS, {"keys": texts(keys)})} if keys else {}

    def read_log_page(self, conn: Connection, after_seq: int, limit: int) -> tuple[list[tuple], list[tuple]]:
        events = _rows(conn, _LOG_EVENTS, {"after": after_seq, "limit": limit})
        if not events:
            return [], []
        return events, _rows(conn, _LOG_POSTINGS, {"first": events[0][0], "last": events[-1][0]})

    def lock_head_and_read(self, conn: Connection, keys: list[str], account_ids: list[int],
                           holds_closed: dict[int, int] | None = None) -> HeadRead:
        """The lock and both reads in one round trip: each read runs
        after the lock is held, so it sees what committed while it waited.
        The holds the batch expects to close are announced in the same trip,
        none too: that replaces whatever an earlier batch of the transaction,
        which then wrote nothing, or a default of the settings left there."""
        holds_closed = holds_closed or {}
        conn.info[_HOLDS_CLOSED_ANNOUNCED] = (conn.get_transaction(), holds_closed)
        # A second append in a durable batch: what the first one kept for the
        # COMMIT (its events if few, its head's move) goes first, before this
        # one announces its closes.
        earlier = _take_carried(conn)
        # No key to look up (settlements that closed their holds, all of most batches): no statement for them.
        keys_read = [(_KNOWN_KEYS, {"keys": texts(keys)})] if keys else []
        try:
            ours = _statements_rows(conn, [*earlier,
                (_LOCK_HEAD, {}), *keys_read, (_BALANCES, {"ids": ints(account_ids)}),
                (_ANNOUNCE_HOLDS_CLOSED, _closes(holds_closed)),
            ])[len(earlier):]
        except psycopg.errors.UndefinedColumn:  # deployed before its migration: nothing is written
            raise InvariantBroken("the ledger's head has no postings_in_event_row: run `paralon migrate` (migration 0031)") from None
        except psycopg.errors.NotNullViolation as exc:
            raise InvariantBroken(_HEAD_REFUSED) from exc
        except psycopg.errors.UniqueViolation as exc:  # an earlier append's events, carried here
            _note_keys_refused(conn, exc)
            raise DBAPIError.instance(_INSERT_EVENTS, None, exc, psycopg.Error) from exc
        head_rows, *key_rows, balance_rows, _ = ours
        last_seq, last_hash, in_event_row = head_rows[0]
        known = {r[0]: (r[1], r[2], r[3]) for r in key_rows[0]} if key_rows else {}
        return HeadRead(last_seq, last_hash, known, dict(balance_rows), in_event_row)

    def encode_unchained(self, event_columns: list[tuple], event_postings: list[list[tuple[int, int]]], *,
                         in_event_row: bool = False) -> list:
        """Per event: its COPY line between its sequence and its previous
        hash's hex; and its postings: as rows, their lines after their
        event_seq, behind an empty first item, so that `str(seq).join` makes
        them whole (a list); in the event's row, the end of its line (a str)."""
        drafted = []
        for (event_type, payload, key, digest, reverses), postings in zip(event_columns, event_postings):
            if in_event_row:
                legs = _postings_columns(postings)
            else:
                legs = [""]
                for leg, (account_id, amount) in enumerate(postings):
                    legs.append(f"\t{leg}\t{account_id}\t{amount}\n")
            # Most texts need no escape: tested here, not in a call per text. A
            # payload is JSON, whose control characters are escaped: a backslash is all it can hold.
            if not (key.isprintable() and "\\" not in payload and "\\" not in key):
                payload, key = payload.translate(_COPY_ESCAPES), key.translate(_COPY_ESCAPES)
            drafted.append((f"\t{event_type}\t{payload}\t{key}\t{_COPY_BYTEA_HEX}{digest.hex()}"
                            f"\t{_COPY_NULL if reverses is None else reverses}\t{_COPY_BYTEA_HEX}", legs))
        return drafted

    def write_appended(self, conn: Connection, batch: AppendedBatch) -> None:
        conn.info[POSTINGS_IN_EVENT_ROW_SEEN] = batch.postings_in_event_row
        head = _head_statement(batch)
        if not _carries_to_commit(conn):
            self._copy_rows(conn, batch)
            _move_head(conn, head)
            return
        if len(batch.events) > EVENTS_INSERTED_WITH_COMMIT_MAX:
            self._copy_rows(conn, batch)
            _carry(conn, [head])
            return
        announced = _announced(conn) == batch.holds_closed
        _carry(conn, [*([] if announced else [(_ANNOUNCE_HOLDS_CLOSED, _closes(batch.holds_closed))]),
                      *_inserts(batch), head])

    def _copy_rows(self, conn: Connection, batch: AppendedBatch) -> None:
        """The batch's events (and postings) by COPY, now: two round trips each."""
        in_event_row, drafted, hexes = batch.postings_in_event_row, batch.drafted, batch.hashes_hex
        if drafted is None or (drafted and isinstance(drafted[0][1], str) != in_event_row):  # drafted the other way
            drafted = self.encode_unchained(batch.events, batch.postings, in_event_row=in_event_row)
        if hexes is None:
            hexes = [h.hex() for h in batch.hashes]
        elif len(hexes) != len(batch.hashes) or hexes[-1] != batch.last_hash.hex():
            raise InvariantBroken("the batch's hashes in hex are not its hashes")
        seqs, chain, at = range(batch.first_seq, batch.last_seq + 1), zip(hexes, hexes[1:]), batch.recorded_at.isoformat()
        with _raw_cursor(conn) as cursor:
            if _announced(conn) != batch.holds_closed:  # a settlement refused under the lock, or no lock announced
                cursor.execute(_ANNOUNCE_HOLDS_CLOSED, _closes(batch.holds_closed))
            if in_event_row:
                _copy(cursor, _COPY_EVENTS_WITH_POSTINGS, "".join([
                    f"{seq}{middle}{prev_hex}\t{_COPY_BYTEA_HEX}{hash_hex}\t{at}{legs}\n"
                    for seq, (middle, legs), (prev_hex, hash_hex) in zip(seqs, drafted, chain, strict=True)]))
                return
            _copy(cursor, _COPY_EVENTS, "".join([f"{seq}{middle}{prev_hex}\t{_COPY_BYTEA_HEX}{hash_hex}\t{at}\n"
                                                 for seq, (middle, _), (prev_hex, hash_hex) in zip(seqs, drafted, chain, strict=True)]))
            if any(batch.postings):
                _copy(cursor, _COPY_POSTINGS, "".join([str(seq).join(legs) for seq, (_, legs) in zip(seqs, drafted, strict=True)]))

    def place_holds(self, conn: Connection, requests: list[PlaceHold], rules: HoldRules) -> list[HoldResult | LedgerError]:
        """The server runs the rules (migration 0015's function): `rules` is not needed."""
        return place_each_key_once(requests, lambda distinct: _call_place_holds(conn, distinct))

    def insert_holds(self, conn: Connection, rows: list[tuple], now: datetime) -> dict[str, int]:
        if not rows:
            return {}
        return {key: hold_id for hold_id, key in _rows(conn, _INSERT_HOLDS, {**_arrays(_NEW_HOLD_ARRAYS, rows), "now": now})}

    def renew_holds(self, conn: Connection, renewals: list[HoldRenewal], metas: list[str | None], now: datetime) -> set[int]:
        return {row[0] for row in _rows(conn, _RENEW_HOLDS, {
            "now": now, "id": ints([r.hold_id for r in renewals]), "ttl_s": ints([r.ttl_s for r in renewals]),
            "capture": ints([r.capture_nano_usd for r in renewals]),
            "owner": nullable_ints([r.owner_account_id if r.capture_nano_usd else None for r in renewals]),
            "request_id": nullable_texts([r.request_id if r.capture_nano_usd else None for r in renewals]),
            "meta": nullable_texts(metas),
        })}

    def close_holds(self, conn: Connection, hold_ids: list[int]) -> list[ClosedHold]:
        return list(map(closed_hold_of, _rows(conn, _CLOSE_HOLDS, {"id": ints(hold_ids)}))) if hold_ids else []

    def take_from_holds(self, conn: Connection, takes: dict[int, int]) -> list[ClosedHold]:
        if not takes:
            return []
        ids = sorted(takes)
        return list(map(closed_hold_of, _rows(conn, _TAKE_FROM_HOLDS, {"id": ints(ids), "amount": ints([takes[i] for i in ids])})))

    def give_back_to_holds(self, conn: Connection, amounts: dict[int, int]) -> None:
        _add(conn, _GIVE_BACK_TO_HOLDS, amounts)

    def reopen_holds(self, conn: Connection, closed: list[ClosedHold]) -> None:
        """The rows as another connection sees them (`_CLOSE_HOLDS`), inserted again in this transaction."""
        if not closed:
            return
        ids = [c.hold_id for c in closed]
        with _outside(conn) as outside:
            rows = [row for (row,) in outside.execute(_HOLD_ROWS, {"id": ints(ids)})]
        if len(rows) != len(ids):
            raise InvariantBroken(f"holds {ids} closed by this batch are not all there for another connection")
        with _raw_cursor(conn) as cursor:
            cursor.execute(_REOPEN_HOLDS, {"row": texts(rows)})

    def add_holds_placed(self, conn: Connection, placed: dict[int, int]) -> None:
        _add(conn, _ADD_PLACED, placed)

    def add_holds_closed(self, conn: Connection, closed: dict[int, int]) -> None:
        _add(conn, _ADD_CLOSED, closed)

    def add_limit_placed(self, conn: Connection, placed: dict[int, int]) -> None:
        _add(conn, _ADD_LIMIT_PLACED, placed)

    def add_limit_usage(self, conn: Connection, usage: dict[int, tuple[int, int]]) -> None:
        if not usage:
            return
        ids = sorted(usage)
        conn.exec_driver_sql(_ADD_LIMIT_USAGE, {"limit_id": ints(ids), "spent": ints([usage[i][0] for i in ids]),
                                                "closed": ints([usage[i][1] for i in ids])})


def _arrays(encoders: dict, rows: list[tuple]) -> dict[str, str]:
    columns = list(zip(*rows)) or [()] * len(encoders)  # no rows: every array empty
    return {name: encode(column) for (name, encode), column in zip(encoders.items(), columns)}


def _closes(holds_closed: dict[int, int]) -> dict[str, str]:
    """The announcement's two settings; none closed is two empty texts, as the trigger leaves them."""
    ids = sorted(holds_closed)
    return {"ids": ints(ids), "amounts": ints([holds_closed[a] for a in ids])} if ids else {"ids": "", "amounts": ""}


def _head_statement(batch: AppendedBatch) -> tuple[str, dict]:
    """The head's move, with the balances and spend limits' usage it checks and adds."""
    ids, limit_ids = sorted(batch.balances), sorted(batch.limit_usage)
    return (_WRITE_APPENDED_WITH_LIMITS if limit_ids else _WRITE_APPENDED, {
        "last_seq": batch.last_seq, "last_hash": batch.last_hash,
        "balance_account_id": ints(ids), "balance": ints([batch.balances[a] for a in ids]),
        "limit_id": ints(limit_ids), "limit_spent": ints([batch.limit_usage[i][0] for i in limit_ids]),
        "limit_closed": ints([batch.limit_usage[i][1] for i in limit_ids]),
    })


def _inserts(batch: AppendedBatch) -> list[tuple[str, tuple]]:
    """A small batch's events (and postings) as INSERT statements, their
    values bound by psycopg: they travel with the COMMIT."""
    at, rows = batch.recorded_at, batch.event_rows()
    if not batch.postings_in_event_row:
        statements = [_values(_INSERT_EVENTS, [(*row, at) for row in rows])]
        if posting_rows := batch.posting_rows():
            statements.append(_values(_INSERT_POSTINGS, posting_rows))
        return statements
    return [_values(_INSERT_EVENTS_WITH_POSTINGS, [(*row, at, *_posting_arrays(legs)) for row, legs in zip(rows, batch.postings, strict=True)])]


def _values(insert: str, rows: list[tuple]) -> tuple[str, tuple]:
    row = "(" + ",".join(["%s"] * len(rows[0])) + ")"
    return insert + ",".join([row] * len(rows)), tuple(value for r in rows for value in r)


def _posting_arrays(postings: list[tuple[int, int]]) -> tuple[str | None, str | None]:
    """An event's legs as its two array columns' literals (NULL when it has none, as the CHECK of 0031 asks)."""
    if not postings:
        return None, None
    return ints([p[0] for p in postings]), ints([p[1] for p in postings])


def _carry(conn: Connection, statements: list[tuple[str, object]]) -> None:
    """Keep `statements` for this transaction's COMMIT (or a later append's lock, whichever runs first)."""
    transaction, carried = conn.info[_CARRIED_TO_COMMIT]
    conn.info[_CARRIED_TO_COMMIT] = (transaction, [*carried, *statements])


def _announced(conn: Connection) -> dict[int, int] | None:
    """What this transaction's lock announced it would close; None: no lock
    announced anything, and the settings hold whatever they hold."""
    transaction, holds_closed = conn.info.pop(_HOLDS_CLOSED_ANNOUNCED, (None, None))
    return holds_closed if transaction is not None and transaction is conn.get_transaction() else None


def _carries_to_commit(conn: Connection) -> bool:
    """Whether this transaction's writes travel with its COMMIT (`begin_durable_batch`)."""
    carried, _ = conn.info.get(_CARRIED_TO_COMMIT, (None, None))
    return carried is not None and carried is conn.get_transaction()


def _take_carried(conn: Connection) -> list[tuple[str, object]]:
    """What this transaction kept for its COMMIT (`_carry`), taken to be sent
    now (by a later append's lock, or by the commit)."""
    if not _carries_to_commit(conn):
        return []
    transaction, carried = conn.info[_CARRIED_TO_COMMIT]
    conn.info[_CARRIED_TO_COMMIT] = (transaction, [])
    return carried


def _move_head(conn: Connection, head: tuple[str, dict]) -> None:
    try:
        conn.exec_driver_sql(*head)
    except DBAPIError as exc:
        _raise_head_refused_or(exc.orig, None, exc)


def _note_keys_refused(conn: Connection, exc: BaseException) -> None:
    """Events carried with a later statement that the keys' unique index
    refused: the batch's next run looks every key up (ledger.store)."""
    if getattr(exc, "sqlstate", None) == _UNIQUE_VIOLATION:
        conn.info[LOOK_UP_EVERY_KEY] = True


def _raise_head_refused_or(exc: BaseException, statement: str | None, wrapped: DBAPIError | None = None) -> None:
    """The head's refusal as InvariantBroken; any other error as SQLAlchemy
    raises a statement's, so the writer tells a lost connection from a refusal."""
    if getattr(exc, "sqlstate", None) == _NOT_NULL_VIOLATION:
        raise InvariantBroken(_HEAD_REFUSED) from exc
    if wrapped is not None:
        raise wrapped
    raise DBAPIError.instance(statement, None, exc, psycopg.Error) from exc


def _postings_columns(postings: list[tuple[int, int]]) -> str:
    """An event's legs as the last two columns of its COPY line: two array
    literals (NULL when it has none, as the CHECK of 0031 asks)."""
    if len(postings) == SETTLEMENT_LEGS:  # the most frequent: one format, not two joins of two lists (a third of the cost)
        (a, amount_a), (b, amount_b), (c, amount_c) = postings
        return f"\t{{{a},{b},{c}}}\t{{{amount_a},{amount_b},{amount_c}}}"
    if not postings:
        return f"\t{_COPY_NULL}\t{_COPY_NULL}"
    return "\t{" + ",".join([str(p[0]) for p in postings]) + "}\t{" + ",".join([str(p[1]) for p in postings]) + "}"


def _copy(cursor, sql: str, text: str) -> None:
    """COPY on the raw cursor, its refusals raised as SQLAlchemy raises a
    statement's (a key used before is an IntegrityError that the writer retries)."""
    try:
        with cursor.copy(sql) as copy:
            copy.write(text)
    except psycopg.DatabaseError as exc:
        raise DBAPIError.instance(sql, None, exc, psycopg.Error) from exc


def _add(conn: Connection, sql: str, amounts: dict[int, int]) -> None:
    if amounts:
        ids = sorted(amounts)
        conn.exec_driver_sql(sql, {"id": ints(ids), "amount": ints([amounts[i] for i in ids])})


def _call_place_holds(conn: Connection, requests: list[PlaceHold]) -> list[HoldResult | LedgerError]:
    now = utc_now()
    params = {
        "account": ints([r.account_id for r in requests]),
        "amount": ints([r.amount_nano_usd for r in requests]),
        "minimum": nullable_ints([r.minimum_nano_usd for r in requests]),
        "key": texts([r.idempotency_key for r in requests]),
        "ttl_s": ints([r.ttl_s for r in requests]),
        "spend_limit": nullable_ints([r.spend_limit_id for r in requests]),
        "replica": nullable_texts([r.replica_id for r in requests]),
        "now": now,
    }
    results: list[HoldResult | LedgerError | None] = [None] * len(requests)
    expiry_by_ttl_s: dict[int, datetime] = {}  # a timedelta and a sum per distinct ttl, not per hold
    for idx, status, hold_id, amount, expires_at, error_code in _rows(conn, _PLACE_HOLDS, params, prepare=True):
        if error_code is not None:
            results[idx] = refusal(requests[idx], error_code, amount)
            continue
        if expires_at is None:  # created: it expires at the `now` sent plus its ttl
            ttl_s = requests[idx].ttl_s
            expires_at = expiry_by_ttl_s.get(ttl_s) or expiry_by_ttl_s.setdefault(ttl_s, now + timedelta(seconds=ttl_s))
        results[idx] = hold_result_of((status, hold_id, amount, expires_at))
    return results  # type: ignore[return-value]


def _outside(conn: Connection) -> psycopg.Connection:
    """A connection of its own to the same database, in autocommit, made
    outside the pool (whose connections may all be held by callers waiting
    for this very batch). Made for each reopen and closed after it: a few
    milliseconds under the append lock, for a settlement refused after its
    hold closed, which the proxy never sends on purpose; kept, one per
    writer's connection, such connections outlived their writers in tests."""
    info = conn.connection.driver_connection.info
    return psycopg.connect(info.dsn, password=info.password, autocommit=True, connect_timeout=DATABASE_CONNECT_TIMEOUT_S)


def _rows(conn: Connection, sql: str, params: dict, *, prepare: bool = False) -> list[tuple]:
    """Run on the transaction's own psycopg connection and return plain tuples;
    `prepare`: prepared on the server, once per connection (unless sent with
    the transaction's BEGIN, in one query of the simple protocol)."""
    if _FLUSH_WAIT_SKIP_PENDING in conn.info or _BEGIN_PENDING in conn.info:
        return _statements_rows(conn, [(sql, params)])[0]
    cursor = _own_cursor(conn, psycopg.Cursor)
    cursor.execute(sql, params, prepare=prepare or None)
    return cursor.fetchall()


def _pending(conn: Connection, name: str) -> bool:
    """Whether this transaction still has `name` to send (and it is taken); a mark an earlier one left is dropped."""
    marked = conn.info.pop(name, None)
    return marked is not None and marked is conn.get_transaction()


def _opening(conn: Connection) -> list[tuple[str, None]]:
    """What this transaction still has to send before its next statement: its BEGIN, its skip of the flush wait."""
    return [(sql, None) for name, sql in ((_BEGIN_PENDING, "BEGIN"), (_FLUSH_WAIT_SKIP_PENDING, _SKIP_FLUSH_WAIT))
            if _pending(conn, name)]


def _raw_cursor(conn: Connection):
    """A cursor on the transaction's own psycopg connection, its opening sent first (a round trip) if still due."""
    _begin_before_statement(conn)
    return conn.connection.driver_connection.cursor()


def _begin_before_statement(conn: Connection, *_) -> None:
    """A transaction begun lazily still to begin: its BEGIN (and its skip of
    the flush wait, if due), sent alone before a statement that cannot carry
    them (SQLAlchemy's, a COPY). An engine listener, so that no statement of
    such a transaction runs outside it."""
    if _BEGIN_PENDING in conn.info and _pending(conn, _BEGIN_PENDING):
        _own_cursor(conn).execute(";\n".join(["BEGIN", *(sql for sql, _ in _opening(conn))]))


def _statements_rows(conn: Connection, statements: list[tuple[str, dict]]) -> list[list[tuple]]:
    """Several statements in one round trip, run in order on the server, each
    reading after the one before it took effect; first, the transaction's
    BEGIN and skip of the flush wait if they are still to send. One query of
    the simple protocol, its parameters written as literals (`pg_literals`,
    as psycopg's client-side binding writes them, in a tenth of its time):
    psycopg's pipeline mode took more, a system call for each message and
    readiness poll. A statement without rows (BEGIN, what an earlier append
    kept for the COMMIT) gives an empty list."""
    opening = _opening(conn)
    cursor = _own_cursor(conn)
    cursor.execute(statements_text(opening + statements))
    rows = [cursor.fetchall() if cursor.pgresult.status == _TUPLES_OK else []]
    while cursor.nextset():
        rows.append(cursor.fetchall() if cursor.pgresult.status == _TUPLES_OK else [])
    return rows[len(opening):]


def _own_cursor(conn: Connection, kind: type[psycopg.Cursor] = ClientCursor) -> psycopg.Cursor:
    """The connection's own cursor of `kind` (the simple protocol's, or the
    extended one's), made once: a cursor's making (its adapters' map) and
    each result's description (a Column per column) cost more than the rest
    of a round trip's Python."""
    cursor = conn.info.get((_OWN_CURSOR, kind))
    if cursor is None or cursor.closed:
        cursor = conn.info[(_OWN_CURSOR, kind)] = kind(conn.connection.driver_connection)
    return cursor
