"""Reading the log in order, and consumers that keep their position exactly once.

Appends are serialised on `ledger_head`, so an event with a higher sequence
number can never become visible before a lower one: reading `seq > position`
in order never skips a late commit.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Callable, Iterator, NamedTuple

from sqlalchemy import Connection, Engine, func, select, update

from ledger.db import storage_of
from ledger.limits import LOG_PAGE_EVENTS_DEFAULT, LOG_PAGE_EVENTS_MAX
from ledger.schema import consumer_positions, ledger_event_postings, ledger_events, utc_now


class StoredEvent(NamedTuple):
    """An event as read back. A tuple, not a dataclass: a replay of a million
    events builds a million of them, and a tuple is built in a third of the time."""

    seq: int
    event_type: str
    payload_json: str
    idempotency_key: str
    recorded_at: datetime
    prev_hash: bytes  # SHA-256
    hash: bytes
    postings: tuple[tuple[int, int], ...] | list[tuple[int, int]] = ()  # (account_id, amount_nano_usd) in leg order

    @property
    def payload(self) -> dict:
        return json.loads(self.payload_json)


def read_events(conn: Connection, after_seq: int, limit: int = LOG_PAGE_EVENTS_DEFAULT, *, with_postings: bool = True) -> list[StoredEvent]:
    """Events with seq > after_seq, in order, postings included unless a reader needs only payloads."""
    rows, postings = storage_of(conn).read_log_page(conn, after_seq, max(1, min(limit, LOG_PAGE_EVENTS_MAX)))
    if not with_postings:
        return [StoredEvent._make(r) for r in rows]
    by_seq: dict[int, list[tuple[int, int]]] = {r[0]: [] for r in rows}
    for seq, account_id, amount in postings:
        if (legs := by_seq.get(seq)) is not None:  # a posting whose event is gone: verify reports it, reading must not fail
            legs.append((account_id, amount))
    return [StoredEvent._make((*r, by_seq[r[0]])) for r in rows]  # _make: tuple.__new__, no Python __new__


def last_seq(conn: Connection) -> int:
    """The seq of the newest event in the log (0 when it is empty)."""
    return conn.execute(select(func.max(ledger_events.c.seq))).scalar_one() or 0


def iter_postings(conn: Connection, through_seq: int, page_events: int = LOG_PAGE_EVENTS_MAX) -> Iterator[list[tuple[int, int, int]]]:
    """Pages of (event seq, account_id, amount_nano_usd), in order, of events 1 to
    `through_seq`: what a replay of balances needs, without the events themselves.
    Paged by seq range, which the log keeps without gaps."""
    p = ledger_event_postings.c
    for start in range(0, through_seq, page_events):
        yield conn.execute(
            select(p.event_seq, p.account_id, p.amount_nano_usd)
            .where(p.event_seq > start, p.event_seq <= min(start + page_events, through_seq))
            .order_by(p.event_seq, p.leg)
        ).all()


Handler = Callable[[Connection, list[StoredEvent]], None]


def consume_once(engine: Engine, consumer: str, handler: Handler, page_size: int = LOG_PAGE_EVENTS_DEFAULT, *,
                 with_postings: bool = True) -> int:
    """Hand the next page of events to `handler` and advance the position in the
    same transaction as the handler's writes: each event takes effect exactly once."""
    with engine.begin() as conn:
        position = conn.execute(
            select(consumer_positions.c.last_seq).where(consumer_positions.c.consumer == consumer).with_for_update()
        ).scalar_one_or_none()
        if position is None:
            conn.execute(consumer_positions.insert().values(consumer=consumer, last_seq=0, updated_at=utc_now()))
            position = 0
        page = read_events(conn, position, page_size, with_postings=with_postings)
        if not page:
            return 0
        handler(conn, page)
        conn.execute(
            update(consumer_positions)
            .where(consumer_positions.c.consumer == consumer)
            .values(last_seq=page[-1].seq, updated_at=utc_now())
        )
        return len(page)


def catch_up(engine: Engine, consumer: str, handler: Handler, *, pages_max: int, with_postings: bool = True,
             progress: Callable[[int], None] | None = None) -> int:
    """`consume_once` until the consumer is at the end of the log, or `pages_max`
    pages; returns the events read."""
    total = 0
    for _ in range(pages_max):
        read = consume_once(engine, consumer, handler, with_postings=with_postings)
        if not read:
            break
        total += read
        if progress is not None:
            progress(read)
    return total


def consumer_position(conn: Connection, consumer: str) -> int:
    return conn.execute(select(consumer_positions.c.last_seq).where(consumer_positions.c.consumer == consumer)).scalar_one_or_none() or 0
