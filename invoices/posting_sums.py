"""An account's postings summed by kind over a period: from the daily read
model (`postings_daily`) when the period is made of whole UTC days, as every
statement, reconciliation and export period is, so that an opening balance
reads a row per day and kind instead of every posting the account ever had;
from the postings themselves otherwise.

`through_seq` fixes a position: the postings of events after it (applied
since) are taken back out, read by the postings' primary key (account, event)
in the same statement as the daily sums, so that both are of one snapshot."""
from __future__ import annotations

from datetime import UTC, datetime, time

from sqlalchemy import BigInteger, Connection, func, literal, select, union_all

from invoices.schema import account_postings, postings_daily

ap, pd = account_postings.c, postings_daily.c
Sums = dict[str, tuple[int, int]]  # source type -> (postings, amount_nano_usd)


def sums_by_kind(conn: Connection, account_id: int, start: datetime | None, end: datetime | None,
                 through_seq: int | None = None) -> Sums:
    """The postings of [start, end) (None: unbounded) per kind, of events up to `through_seq` (None: all applied)."""
    if not (_whole_day(start) and _whole_day(end)):
        return _from_postings(conn, account_id, start, end, through_seq)
    daily = select(pd.source_type, pd.postings.label("postings"), pd.amount_nano_usd.label("amount")).where(
        pd.account_id == account_id, *_day_bounds(start, end))
    parts = [daily]
    if through_seq is not None:
        parts.append(select(ap.source_type, literal(-1, BigInteger).label("postings"), (-ap.amount_nano_usd).label("amount"))
                     .where(ap.account_id == account_id, ap.event_seq > through_seq, *_time_bounds(start, end)))
    both = union_all(*parts).subquery()
    rows = conn.execute(select(both.c.source_type, func.sum(both.c.postings), func.sum(both.c.amount)).group_by(both.c.source_type))
    return {source_type: (int(count), int(amount)) for source_type, count, amount in rows if count}


def balance_before(conn: Connection, account_id: int, start: datetime, through_seq: int | None = None) -> int:
    """The account's balance at `start`: the sum of every posting before it."""
    return sum(amount for _, amount in sums_by_kind(conn, account_id, None, start, through_seq).values())


def _from_postings(conn: Connection, account_id: int, start: datetime | None, end: datetime | None,
                   through_seq: int | None) -> Sums:
    applied = [] if through_seq is None else [ap.event_seq <= through_seq]
    rows = conn.execute(select(ap.source_type, func.count(), func.sum(ap.amount_nano_usd))
                        .where(ap.account_id == account_id, *_time_bounds(start, end), *applied).group_by(ap.source_type))
    return {source_type: (int(count), int(amount)) for source_type, count, amount in rows}


def _whole_day(moment: datetime | None) -> bool:
    return moment is None or moment.astimezone(UTC).time() == time(0)


def _day_bounds(start: datetime | None, end: datetime | None) -> list:
    bounds = [] if start is None else [pd.day >= start.astimezone(UTC).date().isoformat()]
    return bounds + ([] if end is None else [pd.day < end.astimezone(UTC).date().isoformat()])


def _time_bounds(start: datetime | None, end: datetime | None) -> list:
    return ([] if start is None else [ap.recorded_at >= start]) + ([] if end is None else [ap.recorded_at < end])
