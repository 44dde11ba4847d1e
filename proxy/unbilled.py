"""Requests that ended with nothing charged, kept for the account's activity.

A request whose hold is released with nothing charged (every worker failed
before the first token, a worker refused it, a non-streaming answer whose
worker failed, an empty completion, an answer withheld because it could not
be billed, a caller who left before anything was billed) moves no money, so
no ledger event records it. The proxy notes it on the request's own path,
without I/O, and writes what it noted once a second, in one statement (and at
shutdown): a request never waits for this, nor fails because of it. A write
that fails is tried again the next round; a row written twice is kept once
(request ids are unique).

Why a table of its own (`unbilled_generations`) rather than rows of the
`generations` read model with no event: that table is the log's, written only
by its consumer and emptied by `paralon projections rebuild`; rows that no
event carries would be lost by a rebuild, or need a second writer on its rows.
The activity (app/activity.py) reads both."""
from __future__ import annotations

import asyncio
import logging

from sqlalchemy import Engine, text
from sqlalchemy.dialects import postgresql, sqlite

from ledger.db import is_postgres
from ledger.schema import utc_now
from proxy.errors import InvalidRequest, NoWorkerAvailable, ProxyError
from proxy.keys import KeyGrant
from proxy.limits import UNBILLED_PENDING_MAX, UNBILLED_WRITE_LOCK_KEY
from proxy.schema import UNBILLED_STATUSES, unbilled_generations

log = logging.getLogger(__name__)

FAILED, CANCELLED = UNBILLED_STATUSES
# Why nothing was charged
NO_WORKER = "no_worker"  # every worker tried failed before its first token
REFUSED = "refused"  # a worker refused the request (its 400: a prompt too long for it, say)
WORKER_FAILED = "worker_failed"  # the worker failed after its first token, and the caller was billed nothing
EMPTY_COMPLETION = "empty_completion"
WITHHELD = "withheld"  # the answer could not be billed in time, so it was not given (503)
CALLER_LEFT = "caller_left"  # before anything billable was relayed
ERROR = "error"  # anything else that ended it before its first token


def ended_by(exc: BaseException) -> tuple[str, str]:
    """The status and reason of a request that this error ended before anything was relayed."""
    if isinstance(exc, asyncio.CancelledError):
        return CANCELLED, CALLER_LEFT
    if isinstance(exc, NoWorkerAvailable):
        return FAILED, NO_WORKER
    if isinstance(exc, ProxyError) and exc.status == InvalidRequest.status:
        return FAILED, REFUSED
    return FAILED, ERROR


class UnbilledLog:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pending: list[dict] = []
        self.dropped = 0  # noted while the buffer was full (the database away for long)

    def note(self, generation, status: str, reason: str) -> None:
        """A request (a Generation) that ended with nothing charged. No I/O:
        the row is written by the next `flush`."""
        worker = generation.worker
        self.record(generation.request_id, generation.grant, generation.model, worker.id if worker else None,
                    stream=generation.streaming, ttft_ms=generation.ttft_ms, status=status, reason=reason)

    def record(self, request_id: str, grant: KeyGrant, model: str, worker_id: int | None, *, stream: bool,
               ttft_ms: int | None, status: str, reason: str) -> None:
        if len(self._pending) >= UNBILLED_PENDING_MAX:
            self.dropped += 1
            return
        self._pending.append({"request_id": request_id, "account_id": grant.account_id, "api_key_id": grant.id,
                              "model": model, "worker_id": worker_id, "stream": stream, "ttft_ms": ttft_ms,
                              "status": status, "reason": reason, "completed_at": utc_now()})

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.flush()

    async def flush(self) -> None:
        """Write what was noted; kept for the next round if the database is away."""
        rows, self._pending = self._pending, []
        if not rows:
            return
        try:
            await asyncio.to_thread(self._write, rows)
        except Exception:
            log.warning("%d request(s) that cost nothing could not be recorded yet", len(rows), exc_info=True)
            self._pending = (rows + self._pending)[:UNBILLED_PENDING_MAX]
        if self.dropped:
            log.warning("%d request(s) that cost nothing were not recorded: too many waited", self.dropped)
            self.dropped = 0

    def _write(self, rows: list[dict]) -> None:
        with self.engine.begin() as conn:
            if is_postgres(conn):
                # Rows commit in the order of their ids, whichever replica writes them: a reader
                # asking for the rows after id N never misses one committed later with a smaller id.
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": UNBILLED_WRITE_LOCK_KEY})
                insert = postgresql.insert(unbilled_generations)
            else:  # SQLite has one writer at a time
                insert = sqlite.insert(unbilled_generations)
            conn.execute(insert.on_conflict_do_nothing(index_elements=["request_id"]), rows)
