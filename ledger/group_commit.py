"""Group commit: many callers' commands share one transaction.

A writer thread takes what is queued (up to `batch_size_max`, waiting at most
`batch_wait_ms` for more once the first arrives, and no longer once nothing
arrived for `batch_quiet_ms`), runs the whole batch in one
transaction and hands each caller its own result. On PostgreSQL that turns one
fsync per command into one per batch; a command's own failure (an overdraft)
is its result alone and does not fail the batch.

A batch whose connection fails (the database restarted, a backend was
terminated, the network dropped) is run again on a new connection: every
command carries its idempotency key, so one that had committed before the
failure is found, not repeated. While the database stays away its callers
get `DatabaseUnavailable` at once, and the first batch after it comes back
connects again by itself.

Async callers are woken with one `call_soon_threadsafe` per batch, not one per
command: at tens of thousands of commands a second, that is the difference.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Generic, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from ledger.db import APPEND_MARKS, COMMITTED, is_connection_failure, storage_of
from ledger.errors import DatabaseUnavailable, FlushNotConfirmed, LedgerError, WriterClosed, WriterOverloaded, first_line
from ledger.limits import (  # noqa: F401 (the defaults are this module's API too)
    BATCH_QUIET_MS_DEFAULT,
    BATCH_SIZE_MAX_DEFAULT,
    BATCH_WAIT_MS_DEFAULT,
    DATABASE_RETRY_WAITS_S,
    MS_PER_S,
    QUEUE_DEPTH_MAX_DEFAULT,
    TRANSIENT_ATTEMPTS_MAX,
    WRITER_CLOSE_WAIT_S,
)

log = logging.getLogger(__name__)

C = TypeVar("C")
R = TypeVar("R")


class GroupCommitWriter(Generic[C, R]):
    """Runs `apply_batch(conn, commands) -> results` for batches of queued commands."""

    def __init__(
        self,
        engine: Engine,
        apply_batch: Callable[[Connection, list[C]], list[R | LedgerError]],
        *,
        name: str = "ledger-writer",
        batch_size_max: int = BATCH_SIZE_MAX_DEFAULT,
        batch_wait_ms: float = BATCH_WAIT_MS_DEFAULT,
        batch_quiet_ms: float = BATCH_QUIET_MS_DEFAULT,
        queue_depth_max: int = QUEUE_DEPTH_MAX_DEFAULT,
        validate: Callable[[C], None] | None = None,
        autocommit: bool = False,
        flush_after_commit: bool = False,
    ) -> None:
        if batch_size_max < 1 or batch_wait_ms < 0 or batch_quiet_ms < 0 or queue_depth_max < batch_size_max:
            raise ValueError("need batch_size_max >= 1, batch_wait_ms >= 0, batch_quiet_ms >= 0, queue_depth_max >= batch_size_max")
        self._engine = engine
        self._storage = storage_of(engine)
        self._apply_batch = apply_batch
        # A batch that is one statement runs without BEGIN and COMMIT: one round
        # trip in all, the statement being its own transaction.
        self._autocommit = autocommit
        self._conn: Connection | None = None  # kept for the thread's life: no pool check-out per batch
        # Commit without waiting for the WAL flush, then wait for it before
        # answering: the append lock (a row lock, held to the end of the
        # commit) is then free for the next batch while this one's flush runs.
        self._flush_after_commit = flush_after_commit
        self._validate = validate
        self.batch_size_max = batch_size_max
        self.batch_wait_s = batch_wait_ms / MS_PER_S
        self.batch_quiet_s = batch_quiet_ms / MS_PER_S
        self.queue_depth_max = queue_depth_max
        # Items are (command, waiter): a concurrent Future, or (loop, asyncio Future).
        self._queue: deque = deque()
        self._queue_lock = threading.Lock()  # taken bare by each caller: a Condition's own `with` is two Python calls more
        self._ready = threading.Condition(self._queue_lock)
        self._closed = False
        self._database_away = False  # the last batch could not reach it: the next one tries once only
        self.batches_committed = 0
        self.commands_committed = 0
        # Seconds the committed batches held the append lock, by what it was
        # held for: each part named by the moment that ended it (ledger.db's
        # marks, COMMITTED last).
        self.append_lock_parts_s: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def append_lock_held_s(self) -> float:
        """Seconds the committed batches held the append lock (from taking it to
        committing): every append in every process waits for that lock, so
        appends per second cannot exceed 1 / (this / commands) whatever the cores."""
        return sum(self.append_lock_parts_s.values(), 0.0)

    @property
    def native_thread_id(self) -> int | None:
        """The writer thread's id in the operating system (for per-thread CPU)."""
        return self._thread.native_id

    def _put(self, command: C, waiter) -> None:
        if self._closed:
            raise WriterClosed("the writer is closed")
        if self._validate is not None:
            self._validate(command)  # bad input fails at once, before it can join a batch
        with self._queue_lock:
            if len(self._queue) >= self.queue_depth_max:
                raise WriterOverloaded(f"more than {self.queue_depth_max} commands are waiting")
            self._queue.append((command, waiter))
            if len(self._queue) == 1:
                self._ready.notify()

    def submit(self, command: C) -> Future:
        """Queue a command; the future resolves after its batch commits."""
        future: Future = Future()
        self._put(command, future)
        return future

    def execute(self, command: C) -> R:
        """Submit and wait; raises the command's own typed error."""
        return self.submit(command).result()

    def submit_async(self, command: C) -> asyncio.Future:
        """Queue a command from the running event loop; the future resolves on it after its batch commits.
        A command refused at once (invalid, the queue full, the writer closed) fails its future, as any other."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        try:
            self._put(command, (loop, future))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def close(self, timeout_s: float = WRITER_CLOSE_WAIT_S) -> None:
        """Finish what is queued, then stop."""
        with self._ready:
            if self._closed:
                return
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout_s)

    def _take_batch(self) -> list:
        with self._ready:
            while not self._queue:
                if self._closed:
                    return []
                self._ready.wait()
            if self.batch_wait_s and len(self._queue) < self.batch_size_max and not self._closed:
                deadline = time.monotonic() + self.batch_wait_s
                while len(self._queue) < self.batch_size_max and (remaining := deadline - time.monotonic()) > 0:
                    queued = len(self._queue)
                    self._ready.wait(min(remaining, self.batch_quiet_s))  # no one notifies a queue already waited on
                    if len(self._queue) == queued:
                        break  # nothing arrived for batch_quiet_ms
            count = min(len(self._queue), self.batch_size_max)
            return [self._queue.popleft() for _ in range(count)]

    def _run(self) -> None:
        try:
            while batch := self._take_batch():
                self._commit(batch)
        finally:
            if self._conn is not None:
                self._conn.close()

    def _commit(self, batch: list) -> None:
        _deliver(batch, self._apply_with_retries([command for command, _ in batch]))

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.invalidated or self._conn.closed:
            if self._conn is not None:
                self._conn.close()
            conn = self._engine.connect()
            autocommit = self._autocommit or (self._flush_after_commit and self._storage.durable_batches_in_autocommit)
            self._conn = conn.execution_options(isolation_level="AUTOCOMMIT") if autocommit else conn
        return self._conn

    def _apply_once(self, commands: list) -> list:
        conn = self._connection()
        if self._autocommit:
            try:
                results = self._apply_batch(conn, commands)
            except BaseException:
                conn.rollback()
                raise
            conn.commit()  # ends SQLAlchemy's own bookkeeping; the database committed already
            return results
        conn.info.pop(APPEND_MARKS, None)
        with conn.begin():  # its own commit finds the transaction committed already, and sends nothing
            if self._flush_after_commit:
                self._storage.begin_durable_batch(conn)
            results = self._apply_batch(conn, commands)
            if self._flush_after_commit:
                self._commit_and_wait_for_flush(conn, len(commands))
        marks = conn.info.pop(APPEND_MARKS, None)
        if marks:  # the commit's part ends with the flush where both travel together
            self._count_lock_held([*marks, (COMMITTED, time.perf_counter())])
        return results

    def _commit_and_wait_for_flush(self, conn: Connection, commands: int) -> None:
        """Even a batch that wrote nothing may answer from another writer's
        commit not flushed yet. A lost connection runs the batch again (its
        idempotency keys find what committed); a flush that cannot be
        confirmed leaves the batch perhaps committed but not known durable,
        which no caller may be told is done, nor that it failed."""
        try:
            self._storage.commit_and_wait_for_flush(conn)
        except FlushNotConfirmed as exc:  # a DatabaseUnavailable: its callers are told to send it again
            log.error("batch of %d: %s (%s)", commands, exc, first_line(exc.__cause__ or exc))
            raise

    def _count_lock_held(self, marks: list[tuple[str, float]]) -> None:
        for (_, started), (moment, ended) in zip(marks, marks[1:]):
            self.append_lock_parts_s[moment] = self.append_lock_parts_s.get(moment, 0.0) + ended - started

    def _drop_connection(self) -> None:
        """The connection failed: the pool must never hand it out again."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.invalidate()
            conn.close()
        except Exception:  # it is gone either way
            log.debug("closing a failed connection", exc_info=True)

    def _apply_with_retries(self, commands: list) -> list:
        attempt = 1
        reconnect_waits_s = iter(() if self._database_away else DATABASE_RETRY_WAITS_S)
        while True:
            try:
                results = self._apply_once(commands)
            except DatabaseUnavailable as exc:  # committed, not known durable: answered as "try again"
                return [exc] * len(commands)
            except Exception as exc:
                if is_connection_failure(exc):
                    self._drop_connection()
                    wait_s = next(reconnect_waits_s, None)
                    if wait_s is not None:  # idempotency keys make the retry safe
                        time.sleep(wait_s)
                        continue
                    self._database_away = True
                    log.warning("batch of %d: the database is unavailable (%s)", len(commands), first_line(exc))
                    return [DatabaseUnavailable(f"the database is unavailable: {first_line(exc)}") for _ in commands]
                if isinstance(exc, DBAPIError) and attempt < TRANSIENT_ATTEMPTS_MAX and self._storage.is_transient(exc):
                    attempt += 1
                    continue  # idempotency keys make the retry safe
                # A bug, or the database refused the batch: fail every caller loudly, keep serving.
                log.exception("batch of %d failed", len(commands))
                return [exc] * len(commands)
            self._database_away = False
            self.batches_committed += 1
            self.commands_committed += len(commands)
            return results


def _deliver(batch: list, results: list) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for (_, waiter), result in zip(batch, results, strict=True):
        if isinstance(waiter, Future):
            if isinstance(result, BaseException):
                waiter.set_exception(result)
            else:
                waiter.set_result(result)
        else:
            loop, future = waiter
            by_loop.setdefault(loop, []).append((future, result))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, pairs)
        except RuntimeError:  # the caller's loop has closed; nobody is waiting
            pass


def _resolve(pairs: list) -> None:
    for future, result in pairs:
        if future.done():  # the caller was cancelled (e.g. it disconnected)
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
