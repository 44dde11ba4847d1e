"""Column types and index options that read the same on every storage.

The tables (`ledger.schema`) are written once; what each database needs to
keep a column's meaning is decided here.
"""
from __future__ import annotations

from datetime import UTC

from sqlalchemy import BigInteger, DateTime, Integer, String, text
from sqlalchemy.types import TypeDecorator


def exact_text(length_chars_max: int) -> String:
    """Text compared byte for byte (idempotency keys): a linguistic collation buys
    nothing for it and costs every index probe a locale-aware comparison."""
    return String(length_chars_max).with_variant(String(length_chars_max, collation="C"), "postgresql")


# SQLite only autoincrements an INTEGER PRIMARY KEY; PostgreSQL gets BIGINT.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def partial_index(condition: str) -> dict:
    """Index options: only rows meeting `condition` get an entry."""
    return {"postgresql_where": text(condition), "sqlite_where": text(condition)}


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC in and out, on both databases (SQLite stores naive UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime refused: times are UTC-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is None or value.tzinfo is UTC:  # PostgreSQL sessions are in UTC (ledger.storage.postgres)
            return value
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
