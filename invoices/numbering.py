"""Gapless invoice numbers: one counter row per series and year, locked by the
transaction that assigns the next number together with the invoice row that
uses it. A rollback gives the number back (no gap); the invoice row is unique
on the ledger event it invoices (never two documents for one top-up)."""
from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import Connection, select, update

from invoices.limits import DOCUMENT_SEQUENCE_DIGITS
from invoices.schema import invoice_counters, invoices

SERIES_INVOICE = "PAR"
SERIES_CREDIT_NOTE = "PARCN"


class Numbered(NamedTuple):
    number: str
    created: bool  # False: this event already had its document


def format_number(series: str, year: int, sequence: int) -> str:
    return f"{series}-{year}-{sequence:0{DOCUMENT_SEQUENCE_DIGITS}d}"


def assign(conn: Connection, series: str, year: int, source_seq: int, row: dict) -> Numbered:
    """In the caller's transaction: the document for `source_seq`, numbered next
    in (series, year) unless it exists already. `row` holds the other columns."""
    existing = conn.execute(select(invoices.c.number).where(invoices.c.source_seq == source_seq)).scalar()
    if existing is not None:
        return Numbered(existing, False)
    last = conn.execute(
        select(invoice_counters.c.last_number)
        .where(invoice_counters.c.series == series, invoice_counters.c.year == year).with_for_update()
    ).scalar()
    if last is None:
        conn.execute(invoice_counters.insert().values(series=series, year=year, last_number=0))
        last = conn.execute(
            select(invoice_counters.c.last_number)
            .where(invoice_counters.c.series == series, invoice_counters.c.year == year).with_for_update()
        ).scalar_one()
    sequence = last + 1
    conn.execute(update(invoice_counters).where(invoice_counters.c.series == series, invoice_counters.c.year == year)
                 .values(last_number=sequence))
    number = format_number(series, year, sequence)
    conn.execute(invoices.insert().values(number=number, series=series, year=year, sequence=sequence,
                                          source_seq=source_seq, **row))
    return Numbered(number, True)
