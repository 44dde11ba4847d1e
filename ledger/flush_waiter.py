"""Waiting for the WAL flush of committed batches, off the writer's thread.

The durable writer commits each batch without waiting for its flush (the
append lock, a row lock, is then free for the next batch at once) and hands
the batch here; its callers hear nothing yet. This thread takes every batch
handed so far, runs one flush barrier (a transaction that writes WAL and
waits for its flush, which flushes every commit before it too) and then
says so. The writer meanwhile runs its next batch: its commit and this wait
overlap, and one wait covers every batch committed while the one before ran.

A barrier vouches for a commit only on a connection that was open before
that commit and is still open after the barrier: a restart of the server
in between (which may lose the commit) ends every connection. So the writer
opens this thread's connections, before the commits they will answer for
(`epoch_before_commit`), and a batch committed before the connection in use
was opened runs again, as does one whose barrier lost its connection: its
idempotency keys find what committed, or append what was lost.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from sqlalchemy import Connection, Engine

from ledger.db import discard_connection, is_connection_failure, storage_of
from ledger.errors import first_line

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Committed:
    """A batch committed, not yet known flushed: its (command, waiter) pairs,
    their results, how many times it ran again, and the epoch of the
    barrier's connection open before its commit."""
    batch: list
    results: list
    reruns: int
    epoch: int


class FlushWaiter:
    """Calls `flushed(items)` once a barrier vouches for their commits,
    `lost(items, error)` when none can (they must run again), and
    `refused(items, error)` when the server refused the barrier."""

    def __init__(
        self,
        engine: Engine,
        *,
        name: str,
        flushed: Callable[[list[Committed]], None],
        lost: Callable[[list[Committed], BaseException | None], None],
        refused: Callable[[list[Committed], BaseException], None],
    ) -> None:
        self._engine = engine
        self._storage = storage_of(engine)
        self._flushed, self._lost, self._refused = flushed, lost, refused
        self._ready = threading.Condition()
        self._handed: list[Committed] = []
        self._stopping = False
        # The connection in use and its epoch; one the writer opened since,
        # to be used from the next barrier on; whether the one in use was lost.
        self._conn: Connection | None = None
        self._epoch = 0
        self._opened: Connection | None = None
        self._in_use_lost = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def native_thread_id(self) -> int | None:
        return self._thread.native_id

    def epoch_before_commit(self, *, renew: bool = False) -> int:
        """Called by the writer before each commit, on its thread: the epoch of
        a connection open now, opened now if there is none (or `renew`: the
        writer's own connection failed, so this one may have too)."""
        with self._ready:
            if not renew and (self._opened is not None or not self._in_use_lost):
                return self._epoch
        conn = self._engine.connect()  # the pool pings it: it is open before the commit
        with self._ready:
            superseded, self._opened = self._opened, conn
            self._epoch += 1
            epoch = self._epoch
        discard_connection(superseded)  # never used
        return epoch

    def hand(self, committed: Committed) -> None:
        with self._ready:
            self._handed.append(committed)
            if len(self._handed) == 1:
                self._ready.notify()

    def stop(self) -> None:
        """Answer what was handed, then stop: called by the writer's thread as
        it ends, when nothing more can be handed."""
        with self._ready:
            self._stopping = True
            self._ready.notify()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _take(self) -> tuple[list[Committed], Connection | None, int]:
        """Everything handed, and the connection to vouch for it (the one the
        writer opened last, if any) with its epoch."""
        with self._ready:
            while not self._handed and not self._stopping:
                self._ready.wait()
            handed, self._handed = self._handed, []
            replaced = None
            if self._opened is not None:
                replaced, self._conn, self._opened, self._in_use_lost = self._conn, self._opened, None, False
            conn = None if self._in_use_lost else self._conn
            epoch = self._epoch
        if replaced is not None:
            replaced.close()
        return handed, conn, epoch

    def _run(self) -> None:
        try:
            while True:
                handed, conn, epoch = self._take()
                if not handed:
                    break
                try:
                    self._answer(handed, conn, epoch)
                except Exception:  # a bug: this thread must live on, or every later caller would wait for ever
                    log.exception("answering %d committed batches failed", len(handed))
        finally:
            for conn in (self._conn, self._opened):
                if conn is not None:
                    conn.close()

    def _answer(self, handed: list[Committed], conn: Connection | None, epoch: int) -> None:
        vouched, earlier = [], []
        for committed in handed:
            (vouched if conn is not None and committed.epoch == epoch else earlier).append(committed)
        if earlier:  # committed before the connection in use was opened, or it was lost since
            self._lost(earlier, None)
        if vouched:
            self._wait_for(vouched, conn)

    def _wait_for(self, handed: list[Committed], conn: Connection) -> None:
        try:
            self._storage.wait_for_flush(conn)
        except Exception as exc:
            self._answer_failure(handed, exc)
            return
        self._flushed(handed)

    def _answer_failure(self, handed: list[Committed], exc: Exception) -> None:
        commands = sum(len(c.batch) for c in handed)
        if is_connection_failure(exc):
            with self._ready:
                self._in_use_lost = True
            discard_connection(self._conn)
            self._conn = None
            log.warning("the wait for the flush of %d commands lost its connection (%s): they run again", commands, first_line(exc))
            self._lost(handed, exc)
        else:
            log.error("the flush of %d commands could not be confirmed (%s)", commands, first_line(exc))
            self._refused(handed, exc)
