"""Appends as the releases before migrations 0030 and 0035 wrote them on
PostgreSQL, for tests that write on a database migrated only part of the way
(before 0031 too: that release read no layout flag from the head).

That release set, after its postings, every balance it had decided; this one
leaves the balances to the postings themselves and refuses a batch whose
postings did not move them (which, before 0030, they never do). Those
releases wrote every batch's rows by COPY, before the statements after them."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
from sqlalchemy import Connection

from ledger.storage.base import AppendedBatch
from ledger.storage.pg_arrays import ints
from ledger.storage import postgres
from ledger.storage.postgres import PostgresStorage

_SET_BALANCES = """
UPDATE account_balances AS b SET balance_nano_usd = u.balance, last_event_seq = %(last_seq)s
FROM unnest(%(id)s::bigint[], %(balance)s::bigint[]) AS u(account_id, balance) WHERE b.account_id = u.account_id
"""


def set_balances_as_before_0030(conn: Connection, last_seq: int, balances: dict[int, int]) -> None:
    """That release's write after its postings: each balance it decided, and the batch's last event."""
    ids = sorted(balances)
    conn.exec_driver_sql(_SET_BALANCES, {"last_seq": last_seq, "id": ints(ids), "balance": ints([balances[a] for a in ids])})


@contextmanager
def appending_as_before_0030():
    with closing_holds_as_before_0035(), pytest.MonkeyPatch.context() as patch:  # before 0035 too
        write_appended = PostgresStorage.write_appended

        def write_as_before(self, conn: Connection, batch: AppendedBatch) -> None:
            write_appended(self, conn, batch._replace(balances={}))  # nothing to compare: the postings moved none
            set_balances_as_before_0030(conn, batch.last_seq, batch.balances)

        patch.setattr(PostgresStorage, "write_appended", write_as_before)
        # Nor did it know migration 0031's flag: postings were rows.
        patch.setattr(postgres, "_LOCK_HEAD", "SELECT last_seq, last_hash, false FROM ledger_head WHERE id = 1 FOR UPDATE")
        yield


@contextmanager
def closing_holds_as_before_0035():
    """The release before migration 0035: it announced no closes, and added
    them to the balances in its statement after the rows."""
    write_appended = PostgresStorage.write_appended

    def write_as_before(self, conn: Connection, batch: AppendedBatch) -> None:
        write_appended(self, conn, batch)
        self.add_holds_closed(conn, batch.holds_closed)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PostgresStorage, "write_appended", write_as_before)
        patch.setattr(postgres, "_ANNOUNCE_HOLDS_CLOSED", "SELECT %(ids)s, %(amounts)s")  # sets nothing
        patch.setattr(postgres, "EVENTS_INSERTED_WITH_COMMIT_MAX", 0)  # the rows are written before what follows them
        yield
