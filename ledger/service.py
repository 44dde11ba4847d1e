"""The ledger's application functions: what the CLI, the API and integrations call."""
from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from functools import partial
from typing import NamedTuple

from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError

from ledger import accounts as acc
from ledger import commands as cmd
from ledger import holds as hl
from ledger.db import storage_of
from ledger.errors import HoldNotActive, LedgerError
from ledger.group_commit import GroupCommitWriter
from ledger.limits import BATCH_SIZE_MAX_DEFAULT, BATCH_WAIT_MS_DEFAULT, HOLD_BATCH_WAIT_MS_DEFAULT
from ledger.storage.base import in_chunks
from ledger.store import CREATED, AppendResult, append_batch, append_one

log = logging.getLogger(__name__)


class Ledger:
    """One engine, one durable group-commit writer for money, one for holds.

    Holds get their own writer and connections, so placing one never queues
    behind a settlement batch that is waiting for its flush."""

    def __init__(
        self,
        engine: Engine,
        *,
        batch_size_max: int = BATCH_SIZE_MAX_DEFAULT,
        batch_wait_ms: float = BATCH_WAIT_MS_DEFAULT,
        hold_batch_wait_ms: float = HOLD_BATCH_WAIT_MS_DEFAULT,
        flush_after_commit: bool = True,
    ) -> None:
        self.engine = engine
        self.appender: GroupCommitWriter[cmd.Command, AppendResult] = GroupCommitWriter(
            engine, partial(append_batch, closing_keys_to_the_index=True), name="ledger-appender", batch_size_max=batch_size_max,
            batch_wait_ms=batch_wait_ms, validate=cmd.validate_shape, flush_after_commit=flush_after_commit,
        )
        self.holder: GroupCommitWriter[hl.PlaceHold, hl.HoldResult] = GroupCommitWriter(
            engine, hl.place_holds, name="ledger-holds", batch_size_max=batch_size_max,
            batch_wait_ms=hold_batch_wait_ms, validate=hl.validate_place_hold,
            autocommit=storage_of(engine).holds_in_one_statement,
        )

    def close(self) -> None:
        self.appender.close()
        self.holder.close()

    # Accounts and balances
    def create_account(self, kind: str, name: str, email: str | None = None) -> int:
        with self.engine.begin() as conn:
            return acc.create_account(conn, kind, name, email)

    def balance(self, account_id: int) -> acc.BalanceView:
        with self.engine.connect() as conn:
            return acc.read_balance(conn, account_id)

    # Money movements: durable, through group commit
    def append(self, command: cmd.Command) -> AppendResult:
        return self.appender.execute(command)

    def append_async(self, command: cmd.Command) -> asyncio.Future:
        """Queue a command from the event loop now; awaiting the future gives its
        AppendResult (or raises its typed error). A future, not a coroutine:
        two coroutine frames fewer on each settlement's await."""
        return self.appender.submit_async(command)

    # Holds: reservations, committed without waiting for the flush
    def place_hold(self, request: hl.PlaceHold) -> hl.HoldResult:
        return self.holder.execute(request)

    def place_hold_async(self, request: hl.PlaceHold) -> asyncio.Future:
        """Queue a hold from the event loop now; the future resolves with its HoldResult (or typed error) on this loop."""
        return self.holder.submit_async(request)

    hold_placed = place_hold_async  # as the proxy names it: queued before its other work

    def release_hold(self, hold_id: int) -> bool:
        with self.engine.begin() as conn:
            return hl.release_hold(conn, hold_id)

    def split_holds(self, splits: list[tuple[int, hl.PlaceHold]]) -> list[hl.HoldResult | LedgerError]:
        """`holds.split_holds` in a transaction of its own; a key moved by
        another caller meanwhile (the unique index refused it) is answered as stored."""
        try:
            return self._split_holds(splits)
        except IntegrityError:
            return self._split_holds(splits)

    def _split_holds(self, splits: list[tuple[int, hl.PlaceHold]]) -> list[hl.HoldResult | LedgerError]:
        with self.engine.begin() as conn:
            return hl.split_holds(conn, splits)

    def renew_holds(self, renewals: list[hl.HoldRenewal]) -> set[int]:
        with self.engine.begin() as conn:
            return hl.renew_holds(conn, renewals)

    def expire_holds(self) -> SweepResult:
        return sweep_expired_holds(self.engine)

    def holds_of_replica(self, replica_id: str) -> dict[int, datetime]:
        with self.engine.connect() as conn:
            return hl.holds_of_replica(conn, replica_id)

    def settle_orphaned_holds(self, seen: dict[int, datetime]) -> SweepResult:
        return settle_orphaned_holds(self.engine, seen)


class SweepResult(NamedTuple):
    released: int  # expired holds that had delivered nothing
    settled: int  # expired holds settled at the usage they had recorded


def sweep_expired_holds(engine: Engine) -> SweepResult:
    """What the sweeper does: a hold past its expiry is released when its
    request delivered nothing, and settled at its last recorded usage when it
    did (a proxy crashed mid-stream): the customer pays for what they received
    and the owner is paid for it."""
    return _close_holds(engine, hl.expire_holds, hl.expired_captures)


def settle_orphaned_holds(engine: Engine, seen: dict[int, datetime]) -> SweepResult:
    """What a replica restarted after a crash does with the holds its crashed
    run left (`seen`: `holds_of_replica` as it started), at once and as the
    sweeper would: released, or settled at the usage recorded against them.
    A hold renewed since it was seen is in use and left alone."""
    result = SweepResult(0, 0)
    for chunk in in_chunks(sorted(seen)):
        part = {hold_id: seen[hold_id] for hold_id in chunk}
        done = _close_holds(engine, lambda conn: hl.release_orphans(conn, part), lambda conn: hl.orphan_captures(conn, part))
        result = SweepResult(result.released + done.released, result.settled + done.settled)
    return result


def _close_holds(engine: Engine, release_untouched, due_captures) -> SweepResult:
    """Release the untouched holds `release_untouched` closes and append the
    settlements `due_captures` returns. A settlement that finds its hold closed
    meanwhile (the request settled itself) is no error; any other failure
    releases the hold rather than retry it forever."""
    with engine.begin() as conn:
        released = release_untouched(conn)
    with engine.begin() as conn:  # durable: these move money
        due = due_captures(conn)
        results = append_batch(conn, due) if due else []
    settled, unsettleable = 0, []
    for command, result in zip(due, results):
        if isinstance(result, AppendResult):
            settled += result.status == CREATED
        elif not isinstance(result, HoldNotActive):
            log.error("hold %s could not settle at its recorded usage (%s); released", command.hold_id, result)
            unsettleable.append(command.hold_id)
    for hold_id in unsettleable:
        with engine.begin() as conn:
            released += hl.release_hold(conn, hold_id)
    return SweepResult(released, settled)


def append_now(engine: Engine, command: cmd.Command) -> AppendResult:
    """One command in its own transaction, for the CLI and scripts (no writer thread)."""
    cmd.validate_shape(command)
    with engine.begin() as conn:
        return append_one(conn, command)
