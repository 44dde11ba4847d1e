"""Spend limits, reserved exactly like a customer's balance.

A limit (an API key's) has its own `held` and `spent`: a hold that names it is
granted only what limit - spent - held covers, checked in the transaction that
places the hold, so N replicas and M concurrent requests cannot overshoot it.
`spent` grows only with the settlements that capture such holds.
"""
from __future__ import annotations

from sqlalchemy import Connection, select

from ledger.db import storage_of
from ledger.errors import InvalidInput
from ledger.money import require_positive
from ledger.schema import spend_limit_holds, spend_limit_usage
from ledger.storage.base import in_chunks

HELD_NANO_USD = spend_limit_holds.c.holds_placed_nano_usd - spend_limit_usage.c.holds_closed_nano_usd
AVAILABLE_NANO_USD = spend_limit_holds.c.limit_nano_usd - spend_limit_usage.c.spent_nano_usd - HELD_NANO_USD


def create_limit(conn: Connection, limit_id: int, limit_nano_usd: int, spent_nano_usd: int = 0) -> None:
    require_positive(limit_nano_usd, "spend limit")
    if conn.execute(select(spend_limit_holds.c.limit_id).where(spend_limit_holds.c.limit_id == limit_id)).first():
        raise InvalidInput(f"spend limit {limit_id} exists already")
    conn.execute(spend_limit_holds.insert().values(limit_id=limit_id, limit_nano_usd=limit_nano_usd))
    conn.execute(spend_limit_usage.insert().values(limit_id=limit_id, spent_nano_usd=spent_nano_usd))


def read_limits(conn: Connection, limit_ids: list[int]) -> dict[int, dict]:
    """limit, spent, held and available per limit, in ONE statement (one snapshot)."""
    query = (
        select(spend_limit_holds.c.limit_id, spend_limit_holds.c.limit_nano_usd, spend_limit_usage.c.spent_nano_usd,
               HELD_NANO_USD, AVAILABLE_NANO_USD)
        .join(spend_limit_usage, spend_limit_usage.c.limit_id == spend_limit_holds.c.limit_id)
    )
    found = {}
    for chunk in in_chunks(sorted(set(limit_ids))):
        for r in conn.execute(query.where(storage_of(conn).one_of(spend_limit_holds.c.limit_id, chunk))):
            found[r[0]] = {"limit_nano_usd": r[1], "spent_nano_usd": r[2], "held_nano_usd": int(r[3]), "available_nano_usd": int(r[4])}
    return found


def lock_limits(conn: Connection, limit_ids: list[int]) -> None:
    """Serialise hold placement per limit (id order, so two batches never deadlock)."""
    for chunk in in_chunks(sorted(set(limit_ids))):
        conn.execute(
            select(spend_limit_holds.c.limit_id).where(storage_of(conn).one_of(spend_limit_holds.c.limit_id, chunk))
            .order_by(spend_limit_holds.c.limit_id).with_for_update()
        ).all()
