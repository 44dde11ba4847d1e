"""The walk of the whole log, split over processes on PostgreSQL.

Checking an event is Python work (its hash, its payload's canonical form): one
process checks some 40,000 a second, so a log of millions would take minutes.
The log is cut into ranges of seq and each range is walked by its own process,
on its own connection that imports the verifying transaction's snapshot
(`pg_export_snapshot`): every process reads exactly the same log. A range
starts from the stored (seq, hash) of the last event before it, which is where
a walk in one process would stand there, so the checks and what they report
are the same; the reports, balances and progress are added up in order.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import re
from concurrent.futures import Future, ProcessPoolExecutor

from sqlalchemy import Connection, select

from ledger import events as ev
from ledger.chain import Balances, ChainEnd, Progress, VerifyReport, add_balances, walk
from ledger.db import make_engine
from ledger.limits import VERIFY_EVENTS_PER_PROCESS_MIN, VERIFY_PROCESSES_MAX, VERIFY_PROGRESS_POLL_S
from ledger.log import last_seq
from ledger.schema import ledger_events

_SNAPSHOT_ID = re.compile(r"^[0-9A-F]+-[0-9A-F]+-[0-9]+$")  # what pg_export_snapshot returns
_progress_queue = None  # in a range's process: where it reports events checked


def walk_log(conn: Connection, report: VerifyReport, progress: Progress | None = None,
             processes: int | None = 1) -> tuple[Balances, ChainEnd]:
    """`chain.walk` over the whole log, in `processes` processes; None: one per
    core when the log is long enough to repay starting them. One on SQLite, and
    in a daemon process (a Celery worker's), which may not start processes.

    More than one starts processes by "spawn", which imports the caller's main
    module again: only a program whose main module allows it (a guarded
    `__main__`, the `paralon` command) should ask for more than one."""
    through_seq = last_seq(conn)
    if processes is None:
        processes = min(os.cpu_count() or 1, VERIFY_PROCESSES_MAX, through_seq // VERIFY_EVENTS_PER_PROCESS_MIN)
    if processes <= 1 or conn.dialect.name != "postgresql" or multiprocessing.current_process().daemon:
        return walk(conn, report, progress=progress)
    bounds = [through_seq * k // processes for k in range(processes + 1)]
    snapshot = conn.exec_driver_sql("SELECT pg_export_snapshot()").scalar_one()
    url = conn.engine.url.render_as_string(hide_password=False)
    context = multiprocessing.get_context("spawn")
    progress_queue = context.Queue()
    with ProcessPoolExecutor(processes - 1, mp_context=context, initializer=_report_progress_to,
                             initargs=(progress_queue,)) as pool:
        later = [pool.submit(_walk_range, url, snapshot, bounds[k], bounds[k + 1]) for k in range(1, processes)]
        relay = _ProgressRelay(progress_queue, progress)
        balances, end = walk(conn, report, through_seq=bounds[1], progress=relay.own)
        for future in later:
            relay.until_done(future)
            part_report, part_balances, end = future.result()
            report.absorb(part_report)
            add_balances(balances, part_balances)
        relay.drain()
    return balances, end


def _walk_range(url: str, snapshot: str, after_seq: int, through_seq: int) -> tuple[VerifyReport, Balances, ChainEnd]:
    """In a range's process: walk events after_seq+1 .. through_seq in the shared snapshot."""
    if not _SNAPSHOT_ID.match(snapshot):
        raise ValueError(f"not a snapshot id: {snapshot!r}")
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            conn.exec_driver_sql(f"SET TRANSACTION SNAPSHOT '{snapshot}'")  # a literal only; checked above
            report = VerifyReport()
            balances, end = walk(conn, report, _start_of(conn, after_seq), through_seq, progress=_progress_queue.put)
            return report, balances, end
    finally:
        engine.dispose()


def _start_of(conn: Connection, after_seq: int) -> ChainEnd:
    """Where a walk from the first event stands once past `after_seq`: the last event at or before it."""
    row = conn.execute(select(ledger_events.c.seq, ledger_events.c.hash).where(ledger_events.c.seq <= after_seq)
                       .order_by(ledger_events.c.seq.desc()).limit(1)).first()
    return (row[0], bytes(row[1])) if row else (0, ev.GENESIS_HASH)


def _report_progress_to(progress_queue) -> None:
    global _progress_queue
    _progress_queue = progress_queue


class _ProgressRelay:
    """One progress count for every process: this one's, and what the others send."""

    def __init__(self, progress_queue, progress: Progress | None) -> None:
        self.queue, self.progress = progress_queue, progress

    def own(self, events: int) -> None:
        if self.progress is not None:
            self.progress(events)
        self.drain()

    def drain(self) -> None:
        while True:
            try:
                events = self.queue.get_nowait()
            except queue.Empty:
                return
            if self.progress is not None:
                self.progress(events)

    def until_done(self, future: Future) -> None:
        while not future.done():
            try:
                events = self.queue.get(timeout=VERIFY_PROGRESS_POLL_S)
            except queue.Empty:
                continue
            if self.progress is not None:
                self.progress(events)
