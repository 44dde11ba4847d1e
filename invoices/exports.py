"""The ledger export: one CSV row per posting of an account in a period, with
the running balance, so an accountant can tie every row to the statement
(opening balance, sums per kind, closing balance) without any rounding.

Rows are read from the postings read model in pages (keyset, never OFFSET),
so an export of any size streams in bounded memory."""
from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import BigInteger, Engine, Integer, literal, select, tuple_

from invoices import posting_sums, read_models, statements
from invoices.limits import CATCH_UP_ROUNDS_MAX, EXPORT_PAGE_ROWS
from invoices.schema import account_postings
from ledger.errors import InvalidInput
from ledger.log import consumer_position
from ledger.money import nano_usd_to_usd_text
from ledger.schema import UTCDateTime

CSV_COLUMNS = ("event_seq", "leg", "recorded_at", "event_type", "source_type", "amount_nano_usd", "amount_usd",
               "balance_after_nano_usd", "model", "api_key_id", "worker_id", "reference")
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")

ap = account_postings.c


def parse_period_bound(text: str, name: str) -> datetime:
    """'2026-11' or '2026-11-29': the UTC instant that day or month starts."""
    for pattern in ("%Y-%m-%d", "%Y-%m"):
        try:
            return datetime.strptime(text, pattern).replace(tzinfo=UTC)
        except ValueError:
            continue
    raise InvalidInput(f"{name} must be YYYY-MM or YYYY-MM-DD, not {text!r}")


@dataclass(frozen=True)
class ExportTotals:
    opening_balance_nano_usd: int
    closing_balance_nano_usd: int
    postings: int
    through_seq: int  # the read model's position when the export began: later postings are in neither these nor the rows


def _period(account_id: int, start: datetime | None, end: datetime | None, through_seq: int) -> list:
    where = [ap.account_id == account_id, ap.event_seq <= through_seq]
    if start is not None:
        where.append(ap.recorded_at >= start)
    if end is not None:
        where.append(ap.recorded_at < end)
    return where


def prepare(engine: Engine, account_id: int, start: datetime | None, end: datetime,
            rounds_max: int = CATCH_UP_ROUNDS_MAX) -> ExportTotals:
    """Catch the read models up to `end`, then the export's totals as of that moment."""
    statements.ensure_applied(engine, end, rounds_max)
    with engine.connect() as conn:
        through_seq = consumer_position(conn, read_models.CONSUMER)
    return totals(engine, account_id, start, end, through_seq)


def totals(engine: Engine, account_id: int, start: datetime | None, end: datetime | None, through_seq: int) -> ExportTotals:
    with engine.connect() as conn:
        opening = 0 if start is None else posting_sums.balance_before(conn, account_id, start, through_seq)
        period = posting_sums.sums_by_kind(conn, account_id, start, end, through_seq).values()
    count, moved = sum(n for n, _ in period), sum(amount for _, amount in period)
    return ExportTotals(opening, opening + moved, count, through_seq)


def _text(value: str) -> str:
    """A text cell a spreadsheet will not run as a formula."""
    return "'" + value if value.startswith(_FORMULA_STARTS) else value


def csv_chunks(engine: Engine, account_id: int, start: datetime | None, end: datetime | None,
               totals: ExportTotals, page_rows: int = EXPORT_PAGE_ROWS) -> Iterator[bytes]:
    """The header, then one chunk per page of rows, in time order."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    balance, after, through_seq = totals.opening_balance_nano_usd, None, totals.through_seq
    while True:
        query = select(account_postings).where(*_period(account_id, start, end, through_seq))
        if after is not None:  # a row comparison: each page is one range of the index
            at, seq, leg = after
            query = query.where(tuple_(ap.recorded_at, ap.event_seq, ap.leg) > tuple_(
                literal(at, UTCDateTime), literal(seq, BigInteger), literal(leg, Integer)))
        with engine.connect() as conn:
            rows = conn.execute(query.order_by(ap.recorded_at, ap.event_seq, ap.leg).limit(page_rows)).all()
        for r in rows:
            balance += r.amount_nano_usd
            writer.writerow((r.event_seq, r.leg, r.recorded_at.isoformat(), r.event_type, r.source_type, r.amount_nano_usd,
                             nano_usd_to_usd_text(r.amount_nano_usd), balance, _text(r.model), r.api_key_id, r.worker_id,
                             _text(r.reference)))
        yield buffer.getvalue().encode()
        buffer.seek(0)
        buffer.truncate()
        if len(rows) < page_rows:
            return
        after = (rows[-1].recorded_at, rows[-1].event_seq, rows[-1].leg)
