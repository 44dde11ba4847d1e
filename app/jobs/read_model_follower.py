"""The read models' follower of one `paralon serve` (or `paralon up`) process:
a thread of its own, so it never holds the event loop, that applies new
ledger events to usage and earnings every READ_MODELS_INTERVAL_S while it
holds the applier lease (`invoices.read_models.ApplierLease`). On PostgreSQL
one replica holds it and the others skip until it dies; on SQLite the one
process holds it. Stopped at shutdown, after the drain, between two pages."""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from app.limits import READ_MODELS_FAILURES_TO_YIELD, READ_MODELS_FOLLOWER_STOP_TIMEOUT_S, READ_MODELS_INTERVAL_S
from invoices import read_models

log = logging.getLogger("paralon.read_models")


class ReadModelFollower:
    def __init__(self, engine: Engine, interval_s: float = READ_MODELS_INTERVAL_S) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.applied_events = 0  # by this process, since it started
        self._lease = read_models.ApplierLease(engine)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="read-model-follower")

    @property
    def is_applier(self) -> bool:
        return self._lease.held

    def start(self) -> "ReadModelFollower":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = READ_MODELS_FOLLOWER_STOP_TIMEOUT_S) -> bool:
        """Ask it to stop, wait for the page in hand; True when the thread has ended (the lease released)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def follow_once(self) -> int:
        """Everything new, page by page, if this process is the applier; returns events applied."""
        if not self._lease.acquire():
            return 0
        applied = 0
        while not self._stopping.is_set() and (read := read_models.apply_next_page(self.engine)):
            applied += read
            self.applied_events += read
        return applied

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stopping.is_set():
                try:
                    self.follow_once()
                    failures = 0
                except Exception:  # the database is away for a moment: the next round tries again
                    failures += 1
                    if failures == 1:
                        log.warning("the read models could not follow the log; trying again", exc_info=True)
                    if failures % READ_MODELS_FAILURES_TO_YIELD == 0:  # not a moment: let another replica try
                        log.error("the read models failed %d times in a row; giving up the applier lease", failures,
                                  exc_info=True)
                        self._lease.release()
                self._stopping.wait(self.interval_s)
        finally:
            self._lease.release()


class FollowerState(Collector):
    """Whether this replica is the one applying the read models (exactly one should be)."""

    NAME, HELP = "paralon_read_models_applier", "1 on the replica that applies the read models, 0 on the others."

    def __init__(self, follower: ReadModelFollower) -> None:
        self.follower = follower

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, value=int(self.follower.is_applier))
