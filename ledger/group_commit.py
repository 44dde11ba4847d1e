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

A durable writer commits without waiting for the WAL flush. With nothing
queued behind the batch it waits for the flush itself, in the COMMIT's round
trip, and answers; otherwise (on PostgreSQL) it hands the batch to its flush
waiter (ledger.flush_waiter), which answers the callers once a flush barrier
vouches for the commit, and runs its next batch meanwhile.

Async callers are woken with one `call_soon_threadsafe` per batch, not one per
command: at tens of thousands of commands a second, that is the difference.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Callable, Generic, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from ledger.db import APPEND_MARKS, COMMITTED, discard_connection, is_connection_failure, storage_of
from ledger.errors import DatabaseUnavailable, FlushNotConfirmed, LedgerError, WriterClosed, WriterOverloaded, first_line
from ledger.flush_waiter import Committed, FlushWaiter
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
        # Commit without waiting for the WAL flush, and answer once it is
        # flushed: the append lock (a row lock, held to the end of the commit)
        # is then free for the next batch while this one's flush runs.
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
        # Batches whose wait for the flush lost its connection, with how many
        # times each ran again: run before the queue.
        self._reruns: deque[tuple[list, int]] = deque()
        self._in_flush = 0  # batches handed to the flush waiter, not answered nor handed back yet
        self._flush_connection_suspect = False  # the writer's connection failed: the flush waiter's may have too
        self._flush_waiter = FlushWaiter(engine, name=f"{name}-flush", flushed=self._flushed, lost=self._flush_lost,
                                         refused=self._flush_refused) if flush_after_commit and not self._storage.commits_flushed else None
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

    @property
    def flush_thread_id(self) -> int | None:
        """The flush waiter's thread id in the operating system, if the writer has one."""
        return self._flush_waiter.native_thread_id if self._flush_waiter is not None else None

    def _put(self, command: C, waiter) -> None:
        if self._validate is not None:
            self._validate(command)  # bad input fails at once, before it can join a batch
        with self._queue_lock:
            if self._closed:  # under the lock: the writer's last look at the queue is under it too
                raise WriterClosed("the writer is closed")
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
        """Finish what is queued, answer it, then stop."""
        with self._ready:
            if self._closed:
                return
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout_s)
        if self._flush_waiter is not None:
            self._flush_waiter.join(timeout_s)

    def _take_batch(self) -> tuple[list, int]:
        """The next batch and how many times it ran before; none once closed
        with nothing queued and nothing waiting for its flush."""
        with self._ready:
            while not self._queue and not self._reruns:
                if self._closed and not self._in_flush:
                    return [], 0
                self._ready.wait()
            if self._reruns:
                return self._reruns.popleft()
            if self.batch_wait_s and len(self._queue) < self.batch_size_max and not self._closed:
                deadline = time.monotonic() + self.batch_wait_s
                while len(self._queue) < self.batch_size_max and (remaining := deadline - time.monotonic()) > 0:
                    queued = len(self._queue)
                    # Callers notify an empty queue only; the flush waiter, any time.
                    if not self._ready.wait(min(remaining, self.batch_quiet_s)) and len(self._queue) == queued:
                        break  # nothing arrived for batch_quiet_ms
            count = min(len(self._queue), self.batch_size_max)
            return [self._queue.popleft() for _ in range(count)], 0

    def _run(self) -> None:
        try:
            while True:
                batch, reruns = self._take_batch()
                if not batch:
                    break
                self._commit(batch, reruns)
        finally:
            if self._flush_waiter is not None:  # nothing is left for it: the loop ends when nothing is in flush
                self._flush_waiter.stop()
            if self._conn is not None:
                self._conn.close()

    def _commit(self, batch: list, reruns: int) -> None:
        if reruns:  # its wait for the flush lost its connection: give the database the time a reconnection would
            time.sleep(DATABASE_RETRY_WAITS_S[reruns - 1])
        results, epoch = self._apply_with_retries([command for command, _ in batch], DATABASE_RETRY_WAITS_S[reruns:])
        if epoch is None:
            _deliver(batch, results)
            return
        with self._queue_lock:
            self._in_flush += 1
        self._flush_waiter.hand(Committed(batch, results, reruns, epoch))

    # The flush waiter's answers, on its thread. Even a batch that wrote
    # nothing may answer from another writer's commit not flushed yet: every
    # committed batch waits for a flush.
    def _flushed(self, handed: list[Committed]) -> None:
        try:
            for committed in handed:
                _deliver(committed.batch, committed.results)
        finally:
            self._leave_flush(handed, [])

    def _flush_lost(self, handed: list[Committed], exc: BaseException | None) -> None:
        """The batches run again (their keys find what committed), those run
        as often as one, as many times in all as a lost connection would;
        then their callers hear that the database is unavailable."""
        again: dict[int, list] = {}
        try:
            why = first_line(exc) if exc is not None else "its connections keep changing"
            for committed in handed:
                if committed.reruns < len(DATABASE_RETRY_WAITS_S):
                    again.setdefault(committed.reruns + 1, []).extend(committed.batch)
                else:
                    _deliver(committed.batch, [DatabaseUnavailable(f"the database is unavailable: {why}")] * len(committed.batch))
        finally:
            self._leave_flush(handed, [(batch, reruns) for reruns, batch in again.items()])

    def _flush_refused(self, handed: list[Committed], exc: BaseException) -> None:
        """Committed, perhaps, but not known durable: no caller may be told it
        is done, nor that it failed; each is told to send it again."""
        try:
            for committed in handed:
                _deliver(committed.batch, [FlushNotConfirmed()] * len(committed.batch))
        finally:
            self._leave_flush(handed, [])

    def _leave_flush(self, handed: list[Committed], again: list[tuple[list, int]]) -> None:
        with self._ready:
            self._in_flush -= len(handed)
            self._reruns.extend(again)
            self._ready.notify()

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.invalidated or self._conn.closed:
            if self._conn is not None:
                self._conn.close()
            conn = self._engine.connect()
            autocommit = self._autocommit or (self._flush_after_commit and self._storage.durable_batches_in_autocommit)
            self._conn = conn.execution_options(isolation_level="AUTOCOMMIT") if autocommit else conn
        return self._conn

    def _apply_once(self, commands: list) -> tuple[list, int | None]:
        """The batch's results, and the epoch of the flush waiter's connection
        open before its commit if the batch is to wait there for its flush
        (None: its callers may be answered now)."""
        conn = self._connection()
        epoch = None
        if self._flush_waiter is not None:  # before the transaction: a connection it opens must not hold the append lock up
            epoch = self._flush_waiter.epoch_before_commit(renew=self._flush_connection_suspect)
            self._flush_connection_suspect = False
        if self._autocommit:
            try:
                results = self._apply_batch(conn, commands)
            except BaseException:
                conn.rollback()
                raise
            conn.commit()  # ends SQLAlchemy's own bookkeeping; the database committed already
            return results, epoch
        conn.info.pop(APPEND_MARKS, None)
        with conn.begin():  # its own commit finds the transaction committed already, and sends nothing
            if self._flush_after_commit:
                self._storage.begin_durable_batch(conn)
            results = self._apply_batch(conn, commands)
            if self._flush_after_commit:
                # Nothing queued behind it: no batch would run while it waits, and one round trip is the quickest.
                if self._flush_waiter is None or not self._queue:
                    epoch = None
                self._storage.commit_durable_batch(conn, wait_for_flush=epoch is None)
        marks = conn.info.pop(APPEND_MARKS, None)
        if marks:
            self._count_lock_held([*marks, (COMMITTED, time.perf_counter())])
        return results, epoch

    def _count_lock_held(self, marks: list[tuple[str, float]]) -> None:
        for (_, started), (moment, ended) in zip(marks, marks[1:]):
            self.append_lock_parts_s[moment] = self.append_lock_parts_s.get(moment, 0.0) + ended - started

    def _apply_with_retries(self, commands: list, waits_s: tuple[float, ...]) -> tuple[list, int | None]:
        """The batch's results and where it waits for its flush (`_apply_once`);
        or, if it could not commit, the error each of its callers is told and None."""
        attempt = 1
        reconnect_waits_s = iter(() if self._database_away else waits_s)
        while True:
            try:
                results, epoch = self._apply_once(commands)
            except FlushNotConfirmed as exc:  # committed, not known durable: a DatabaseUnavailable, "send it again"
                log.error("batch of %d: %s (%s)", len(commands), exc, first_line(exc.__cause__ or exc))
                return [exc] * len(commands), None
            except Exception as exc:
                if is_connection_failure(exc):
                    discard_connection(self._conn)
                    self._conn = None
                    self._flush_connection_suspect = True
                    wait_s = next(reconnect_waits_s, None)
                    if wait_s is not None:  # idempotency keys make the retry safe
                        time.sleep(wait_s)
                        continue
                    self._database_away = True
                    log.warning("batch of %d: the database is unavailable (%s)", len(commands), first_line(exc))
                    return [DatabaseUnavailable(f"the database is unavailable: {first_line(exc)}") for _ in commands], None
                if isinstance(exc, DBAPIError) and attempt < TRANSIENT_ATTEMPTS_MAX and self._storage.is_transient(exc):
                    attempt += 1
                    continue  # idempotency keys make the retry safe
                # A bug, or the database refused the batch: fail every caller loudly, keep serving.
                log.exception("batch of %d failed", len(commands))
                return [exc] * len(commands), None
            self._database_away = False
            self.batches_committed += 1
            self.commands_committed += len(commands)
            return results, epoch


def _deliver(batch: list, results: list) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for (_, waiter), result in zip(batch, results, strict=True):
        if isinstance(waiter, Future):
            try:
                if isinstance(result, BaseException):
                    waiter.set_exception(result)
                else:
                    waiter.set_result(result)
            except InvalidStateError:  # the caller cancelled it; nobody is waiting
                pass
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
