"""The one seam between the ledger and its database.

Everything that differs between PostgreSQL and SQLite is a method of
`Storage`: how an engine is made, how a batch reads under the append lock and
writes what it decided, how holds are placed, renewed and closed. The rules
(`ledger.store`, `ledger.holds`, ...) call these methods and never ask which
database they are on. `ledger.db` chooses the implementation once, from the
engine's URL (`postgres.PostgresStorage`, `sqlite.SqliteStorage`).

Rows cross the seam as plain tuples in the column orders named here: a batch
of a thousand settlements should not build a thousand dicts to say what it wrote.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime
from functools import partial
from typing import Callable, ClassVar, Iterator, NamedTuple

from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from ledger.errors import FlushNotConfirmed, LedgerError
from ledger.hold_commands import HoldRenewal, HoldResult, PlaceHold
from ledger.limits import IN_CLAUSE_VALUES_MAX
from ledger.schema import account_balances, holds, ledger_event_postings, ledger_events

# An event as the log is read back (ledger.log.StoredEvent's order, postings apart).
STORED_EVENT_COLUMNS = ("seq", "event_type", "payload", "idempotency_key", "recorded_at", "prev_hash", "hash")
EVENT_COLUMNS = ("seq", "event_type", "payload", "idempotency_key", "content_digest", "reverses_seq", "prev_hash", "hash")
POSTING_COLUMNS = ("event_seq", "leg", "account_id", "amount_nano_usd")
NEW_HOLD_COLUMNS = ("account_id", "amount_nano_usd", "idempotency_key", "ttl_s", "spend_limit_id", "replica_id")
# A whole hold row, as the table has it.
HOLD_ROW = ("id", "account_id", "amount_nano_usd", "idempotency_key", "created_at", "expires_at", "spend_limit_id",
            "capture_nano_usd", "capture_owner_account_id", "capture_request_id", "capture_meta", "replica_id")


class ClosedHold(NamedTuple):
    """A hold a settlement closed: what its rules read, and whatever the
    storage needs to put it back (`reopen_holds`: SQLite its whole row,
    PostgreSQL nothing, reading the row as another connection sees it),
    which the settlement never reads."""

    hold_id: int
    account_id: int
    amount_nano_usd: int
    spend_limit_id: int | None
    row: object


closed_hold_of = partial(tuple.__new__, ClosedHold)  # from a 5-tuple, as ledger.events.posting_of


# In a connection's `info`: where its last append wrote postings, so the next
# drafts them that way before the lock tells.
POSTINGS_IN_EVENT_ROW_SEEN = "paralon_postings_in_event_row"
# In a connection's `info`: its last batch was refused by the log's unique
# index on idempotency keys, so the next one looks every key up (ledger.store).
LOOK_UP_EVERY_KEY = "paralon_look_up_every_key"

KnownKeys = dict[str, tuple[bytes, int, str]]  # idempotency key -> (content digest, seq, event type)
HoldRules = Callable[[Connection, list[PlaceHold]], list[HoldResult | LedgerError]]


class HeadRead(NamedTuple):
    """What an append reads once it holds the append lock."""

    last_seq: int
    last_hash: bytes
    known_keys: KnownKeys  # of the keys asked about, those committed meanwhile
    balances: dict[int, int]  # account id -> balance_nano_usd
    postings_in_event_row: bool = False  # ledger_head's flag (migration 0031): where this batch writes postings


class AppendedBatch(NamedTuple):
    """Everything a decided batch writes. Its events are kept as the append
    decided them under the lock (columns, legs, hashes), where every
    microsecond is every process's; only a storage that writes rows builds
    them (`event_rows`, `posting_rows`)."""

    events: list[tuple]  # each event's EVENT_COLUMNS from event_type to reverses_seq
    postings: list[list[tuple[int, int]]]  # each event's legs: (account id, amount)
    hashes: list[bytes]  # the chain's hash before the batch, then each event's
    balances: dict[int, int]  # account id -> its new balance
    holds_closed: dict[int, int]  # customer -> the full amount of the holds the batch settled
    limit_usage: dict[int, tuple[int, int]]  # spend limit -> (spent, hold amounts closed)
    last_seq: int
    recorded_at: datetime
    # What `encode_unchained` drafted before the lock of each event written, in
    # events' order, and the chain's hashes in hex: as the append computed
    # them, so they are not made again. None: the storage drafts nothing, or
    # the rows were not drafted.
    drafted: list | None = None
    hashes_hex: list[str] | None = None
    postings_in_event_row: bool = False  # as the head said under the lock

    @property
    def first_seq(self) -> int:
        return self.last_seq - len(self.events) + 1

    @property
    def last_hash(self) -> bytes:
        return self.hashes[-1]

    def event_rows(self) -> list[tuple]:
        """EVENT_COLUMNS, one row per event."""
        first, hashes = self.first_seq, self.hashes
        return [(first + k, *columns, hashes[k], hashes[k + 1]) for k, columns in enumerate(self.events)]

    def posting_rows(self) -> list[tuple]:
        """POSTING_COLUMNS, each event's legs numbered from 0."""
        first = self.first_seq
        return [(first + k, leg, account_id, amount)
                for k, legs in enumerate(self.postings) for leg, (account_id, amount) in enumerate(legs)]


def in_chunks(values: list, size: int = IN_CLAUSE_VALUES_MAX) -> Iterator[list]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


class Storage(ABC):
    """A database the ledger runs on. Methods that take a connection work in
    the caller's transaction and never commit it."""

    dialect: ClassVar[str]  # SQLAlchemy's name for it
    url_backends: ClassVar[tuple[str, ...]]  # URL schemes that name it
    # Whether `place_holds` is one statement: a group-commit batch of holds then
    # runs without BEGIN and COMMIT, the statement being its own transaction.
    holds_in_one_statement: ClassVar[bool]
    # Whether events can carry their postings in their own row (migration 0031).
    postings_in_event_row_possible: ClassVar[bool] = False

    # Engines and transactions
    @abstractmethod
    def engine_url(self, url: URL) -> URL:
        """`url` with the driver Paralon ships; BadDatabaseUrl when it cannot hold a ledger."""

    @abstractmethod
    def create_engine(self, url: URL, *, pool_size: int) -> Engine:
        """An engine whose transactions serialise as the ledger's rules expect."""

    @abstractmethod
    def snapshot_connection(self, engine: Engine) -> Connection:
        """A connection whose reads all see one state of the database: verify
        reads the log, the head and the balances in many statements while
        appends go on."""

    # The durable writer's connection is in autocommit, and the storage
    # begins each of its transactions itself (`begin_durable_batch`).
    durable_batches_in_autocommit: ClassVar[bool] = False
    # Every commit is flushed before it returns: the durable writer answers
    # at once, with no flush waiter.
    commits_flushed: ClassVar[bool] = False

    @abstractmethod
    def skip_flush_wait(self, conn: Connection, *, with_next_statement: bool = False) -> None:
        """This transaction's commit need not wait for its flush: used for
        holds only, which a crash may lose without costing anyone anything;
        and the durable writer's batches, which then `wait_for_flush`.
        `with_next_statement`: a storage may send it with the transaction's
        next statement of its own instead of at once (one round trip less);
        if none comes, the commit waits for its flush as any other."""

    def begin_durable_batch(self, conn: Connection) -> None:
        """The durable writer's transaction starts: it skips the flush wait
        and ends with `commit_durable_batch`. A storage may send its BEGIN
        and the skip with its first statement, and keep `write_appended`'s last
        statement, the head's move, to send with the COMMIT. The connection is
        in autocommit (`durable_batches_in_autocommit`) where the BEGIN is its own."""
        self.skip_flush_wait(conn, with_next_statement=True)

    def commit_durable_batch(self, conn: Connection, *, wait_for_flush: bool) -> None:
        """Commit the durable writer's transaction, without waiting for its
        flush, then, with `wait_for_flush`, wait for it; a storage may send
        the head's move kept for it, the COMMIT and the wait as one round trip.
        Any error but FlushNotConfirmed means nothing committed (or, for a
        lost connection, that it is not known whether it did)."""
        conn.connection.dbapi_connection.commit()
        if not wait_for_flush:
            return
        try:
            self.wait_for_flush(conn)
        except Exception as exc:
            if self.is_connection_error(getattr(exc, "orig", exc)):
                raise
            raise FlushNotConfirmed() from exc

    @abstractmethod
    def wait_for_flush(self, conn: Connection) -> None:
        """Return once everything committed before, on any connection, is
        flushed: a batch committed without waiting (so the append lock is
        free for the next) is durable before any caller hears of it. Called
        outside a transaction."""

    # The driver's own error classes among which a failed connection is
    # reported, as its raw connection raises them (statements that bypass
    # SQLAlchemy): SQLAlchemy never sees those.
    driver_connection_errors: ClassVar[tuple[type[BaseException], ...]] = ()

    def is_connection_error(self, error: BaseException | None) -> bool:
        """The driver's error says the connection failed (refused, dropped,
        closed), not that the database refused a statement."""
        return False

    def is_transient(self, exc: DBAPIError) -> bool:
        """Worth one more try: a dropped connection, or what `is_retryable_error` says."""
        return exc.connection_invalidated or self.is_retryable_error(exc.orig)

    @abstractmethod
    def is_retryable_error(self, error: BaseException | None) -> bool:
        """Serialisation failures, deadlocks, and a unique key another process
        inserted meanwhile (the retry finds it and answers `exists` or a conflict)."""

    # Reads
    @abstractmethod
    def one_of(self, column, values: list):
        """The clause `column IN values`."""

    def read_known_keys(self, conn: Connection, keys: list[str]) -> KnownKeys:
        known: KnownKeys = {}
        for chunk in in_chunks(keys):
            rows = conn.execute(
                select(ledger_events.c.idempotency_key, ledger_events.c.content_digest, ledger_events.c.seq,
                       ledger_events.c.event_type)
                .where(self.one_of(ledger_events.c.idempotency_key, chunk))
            )
            known.update({r[0]: (r[1], r[2], r[3]) for r in rows})
        return known

    def read_balances(self, conn: Connection, account_ids: list[int]) -> dict[int, int]:
        balances: dict[int, int] = {}
        for chunk in in_chunks(account_ids):
            balances.update(conn.execute(
                select(account_balances.c.account_id, account_balances.c.balance_nano_usd)
                .where(self.one_of(account_balances.c.account_id, chunk))
            ).all())
        return balances

    def read_log_page(self, conn: Connection, after_seq: int, limit: int) -> tuple[list[tuple], list[tuple]]:
        """The `limit` events after `after_seq` (STORED_EVENT_COLUMNS, recorded_at
        UTC-aware) and their postings (event seq, account_id, amount) in leg order."""
        events = conn.execute(
            select(*(ledger_events.c[name] for name in STORED_EVENT_COLUMNS))
            .where(ledger_events.c.seq > after_seq).order_by(ledger_events.c.seq).limit(limit)
        ).all()
        if not events:
            return [], []
        p = ledger_event_postings.c
        return events, conn.execute(
            select(p.event_seq, p.account_id, p.amount_nano_usd)
            .where(p.event_seq.between(events[0][0], events[-1][0])).order_by(p.event_seq, p.leg)
        ).all()

    @abstractmethod
    def lock_head_and_read(self, conn: Connection, keys: list[str], account_ids: list[int],
                           holds_closed: dict[int, int] | None = None) -> HeadRead:
        """Take the append lock, then read (after it, so every batch committed
        before is seen) which of `keys` are in the log and these balances.
        `holds_closed`: what the batch expects to close (customer: amount),
        which a storage may send ahead of its write; `write_appended` is
        given what it did close, whatever was expected."""

    # Appends
    @abstractmethod
    def write_appended(self, conn: Connection, batch: AppendedBatch) -> None:
        """Events, postings, balances, spend limits and the head of the chain."""

    def encode_unchained(self, event_columns: list[tuple], event_postings: list[list[tuple[int, int]]], *,
                         in_event_row: bool = False) -> list | None:
        """What `write_appended` can encode of each event before the append
        lock, so the lock is held for less; None: nothing. `event_columns` are
        EVENT_COLUMNS from event_type to reverses_seq: all but what the lock
        decides (the sequence and the hashes); `event_postings` are each
        event's (account_id, amount_nano_usd) legs in order; `in_event_row`:
        drafted for postings in the event's row (the head may yet say otherwise)."""
        return None

    # Holds
    @abstractmethod
    def place_holds(self, conn: Connection, requests: list[PlaceHold], rules: HoldRules) -> list[HoldResult | LedgerError]:
        """One result per request. `rules` places them in this process, statement
        by statement; a database that runs the same rules itself need not call it."""

    @abstractmethod
    def insert_holds(self, conn: Connection, rows: list[tuple], now: datetime) -> dict[str, int]:
        """rows: NEW_HOLD_COLUMNS tuples; returns hold id by idempotency key."""

    @abstractmethod
    def renew_holds(self, conn: Connection, renewals: list[HoldRenewal], metas: list[str | None], now: datetime) -> set[int]:
        """Push back each expiry and record the capture (never lowered, never
        above the hold; `metas` is each capture's metadata as canonical JSON).
        Returns the ids of the holds that still existed."""

    @abstractmethod
    def close_holds(self, conn: Connection, hold_ids: list[int]) -> list[ClosedHold]:
        """Delete these holds; returns each one that existed."""

    def reopen_holds(self, conn: Connection, closed: list[ClosedHold]) -> None:
        """Put back holds closed for settlements that then failed under the append lock (rare).
        Here `row` is a HOLD_ROW tuple."""
        if closed:
            conn.execute(holds.insert(), [dict(zip(HOLD_ROW, c.row)) for c in closed])

    def take_from_holds(self, conn: Connection, takes: dict[int, int]) -> list[ClosedHold]:
        """Take each amount from its hold, which stays open with the rest (the
        captures that are not final); returns a ClosedHold of the amount taken
        for each hold that had that much left. The holds are taken in id order."""
        taken = []
        for hold_id, amount in sorted(takes.items()):
            row = conn.execute(update(holds).where(holds.c.id == hold_id, holds.c.amount_nano_usd >= amount)
                               .values(amount_nano_usd=holds.c.amount_nano_usd - amount)
                               .returning(holds.c.account_id, holds.c.spend_limit_id)).first()
            if row is not None:
                taken.append(closed_hold_of((hold_id, row.account_id, amount, row.spend_limit_id, None)))
        return taken

    def give_back_to_holds(self, conn: Connection, amounts: dict[int, int]) -> None:
        """`take_from_holds` undone for captures refused under the append lock (rare)."""
        for hold_id, amount in sorted(amounts.items()):
            conn.execute(update(holds).where(holds.c.id == hold_id).values(amount_nano_usd=holds.c.amount_nano_usd + amount))

    # Reservation counters: customer -> amount, spend limit -> amount
    @abstractmethod
    def add_holds_placed(self, conn: Connection, placed: dict[int, int]) -> None: ...

    @abstractmethod
    def add_holds_closed(self, conn: Connection, closed: dict[int, int]) -> None:
        """Released or expired holds stop counting against their customers."""

    @abstractmethod
    def add_limit_placed(self, conn: Connection, placed: dict[int, int]) -> None: ...

    @abstractmethod
    def add_limit_usage(self, conn: Connection, usage: dict[int, tuple[int, int]]) -> None:
        """usage: limit id -> (spent by settlements, hold amounts closed)."""

    def add_limit_closed(self, conn: Connection, closed: dict[int, int]) -> None:
        """Released or expired holds stop counting against their limits."""
        self.add_limit_usage(conn, {i: (0, amount) for i, amount in closed.items()})
