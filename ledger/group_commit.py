"""Group commit: many callers' commands share one transaction.

A writer thread takes what is queued (up to `batch_size_max`, waiting at most
`batch_wait_ms` for more once the first arrives), runs the whole batch in one
transaction and resolves each caller's future with its own result. On
PostgreSQL that turns one fsync per command into one per batch; a command's
own failure (an overdraft) is its result alone and does not fail the batch.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Generic, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from ledger.errors import LedgerError, WriterClosed, WriterOverloaded

log = logging.getLogger(__name__)

C = TypeVar("C")
R = TypeVar("R")

BATCH_SIZE_MAX_DEFAULT = 512
BATCH_WAIT_MS_DEFAULT = 1.0
QUEUE_DEPTH_MAX_DEFAULT = 50_000
TRANSIENT_RETRIES_MAX = 3


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
        queue_depth_max: int = QUEUE_DEPTH_MAX_DEFAULT,
        validate: Callable[[C], None] | None = None,
    ) -> None:
        if batch_size_max < 1 or batch_wait_ms < 0 or queue_depth_max < batch_size_max:
            raise ValueError("need batch_size_max >= 1, batch_wait_ms >= 0, queue_depth_max >= batch_size_max")
        self._engine = engine
        self._apply_batch = apply_batch
        self._validate = validate
        self.batch_size_max = batch_size_max
        self.batch_wait_s = batch_wait_ms / 1000
        self._queue: queue.Queue[tuple[C, Future] | None] = queue.Queue(maxsize=queue_depth_max)
        self._closed = False
        self.batches_committed = 0
        self.commands_committed = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, command: C) -> Future:
        """Queue a command; the future resolves after its batch commits."""
        if self._closed:
            raise WriterClosed("the writer is closed")
        if self._validate is not None:
            self._validate(command)  # bad input fails at once, before it can join a batch
        future: Future = Future()
        try:
            self._queue.put_nowait((command, future))
        except queue.Full:
            raise WriterOverloaded(f"more than {self._queue.maxsize} commands are waiting") from None
        return future

    def execute(self, command: C) -> R:
        """Submit and wait; raises the command's own typed error."""
        return self.submit(command).result()

    async def execute_async(self, command: C) -> R:
        return await asyncio.wrap_future(self.submit(command))

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued, then stop."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _take_batch(self) -> tuple[list[tuple[C, Future]], bool]:
        first = self._queue.get()
        if first is None:
            return [], True
        batch = [first]
        deadline = time.monotonic() + self.batch_wait_s
        while len(batch) < self.batch_size_max:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining_s)
                except queue.Empty:
                    break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self._take_batch()
            if batch:
                self._commit(batch)

    def _commit(self, batch: list[tuple[C, Future]]) -> None:
        commands = [command for command, _ in batch]
        for attempt in range(1, TRANSIENT_RETRIES_MAX + 1):
            try:
                with self._engine.begin() as conn:
                    results = self._apply_batch(conn, commands)
                break
            except (OperationalError, DBAPIError) as exc:
                if attempt == TRANSIENT_RETRIES_MAX or not _is_transient(exc):
                    log.exception("batch of %d failed", len(batch))
                    for _, future in batch:
                        future.set_exception(exc)
                    return
            except BaseException as exc:  # a bug: fail every caller loudly, keep serving
                log.exception("batch of %d failed", len(batch))
                for _, future in batch:
                    future.set_exception(exc)
                return
        self.batches_committed += 1
        self.commands_committed += len(batch)
        for (_, future), result in zip(batch, results):
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


def _is_transient(exc: DBAPIError) -> bool:
    """Serialisation failures, deadlocks and dropped connections are worth one more try."""
    if exc.connection_invalidated:
        return True
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return sqlstate in ("40001", "40P01")
