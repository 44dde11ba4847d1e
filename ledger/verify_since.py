"""Verification from a checkpoint, cheap enough to run every few minutes.

`ledger.verify.verify` replays the whole log in Python. This proves the chain
only from a checkpoint: the last event a previous scheduled run proved (kept
in `ledger_verifications`), or an anchor outside that vouches for the chain up
to it (`ledger verify --since-anchor`, what a restored backup needs). Every
balance is checked against the sum of its postings in one aggregate the
database runs, every event's postings summing to zero in another, and the hold
and spend-limit counters as a full verification does. An edit before the
checkpoint that kept its stored hash needs the full `verify`. Run it on a
snapshot connection.
"""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, func, select, text, update

from ledger.chain import REFUND_EVENT_TYPES, Progress, VerifyReport, check_head, walk
from ledger.schema import ledger_event_postings, ledger_events, ledger_verifications, utc_now
from ledger.verify import _check_balances, _check_hold_counters, _check_spend_limits

_POSTINGS_OF_NO_EVENT = text("""
SELECT DISTINCT p.event_seq FROM ledger_postings p
WHERE NOT EXISTS (SELECT 1 FROM ledger_events e WHERE e.seq = p.event_seq) ORDER BY 1
""")

# The chain check sums the postings of the events it reads (those since the
# checkpoint); a posting added later to an older event is found only here.
_EVENTS_NOT_SUMMING_TO_ZERO = text("""
SELECT event_seq, sum(amount_nano_usd) FROM ledger_event_postings GROUP BY event_seq HAVING sum(amount_nano_usd) <> 0 ORDER BY 1
""")


@dataclass(frozen=True)
class Checkpoint:
    seq: int
    hash: bytes


def read_checkpoint(conn: Connection) -> Checkpoint:
    row = conn.execute(select(ledger_verifications.c.verified_seq, ledger_verifications.c.verified_hash)
                       .where(ledger_verifications.c.id == 1)).one()
    return Checkpoint(row.verified_seq, bytes(row.verified_hash))


def verify_since(conn: Connection, start: Checkpoint, progress: Progress | None = None) -> tuple[VerifyReport, Checkpoint]:
    """The report, and how far the chain is now proven (`start` again if it failed)."""
    report = VerifyReport()
    end = _check_chain_from(conn, start, report, progress)
    report.refunded_by_account = _refunded_by_account(conn)
    p = ledger_event_postings.c
    totals = conn.execute(select(p.account_id, func.sum(p.amount_nano_usd)).group_by(p.account_id)).all()
    _check_balances(conn, {account_id: int(total) for account_id, total in totals}, report)
    _check_postings(conn, report)
    _check_hold_counters(conn, report)
    _check_spend_limits(conn, report)
    return report, (end if report.ok else start)


def record(conn: Connection, report: VerifyReport, proven: Checkpoint) -> None:
    conn.execute(update(ledger_verifications).where(ledger_verifications.c.id == 1).values(
        verified_seq=proven.seq, verified_hash=proven.hash, checked_at=utc_now(), ok=report.ok,
        problems_total=report.problems_total, first_problem=report.problems[0] if report.problems else None))


def last_result(conn: Connection) -> dict:
    """What `record` kept of the last scheduled run: ok is None (and checked_at too) before the first."""
    v = ledger_verifications.c
    row = conn.execute(select(v.ok, v.verified_seq, v.checked_at, v.problems_total, v.first_problem).where(v.id == 1)).one()
    return {"ok": row.ok, "verified_seq": row.verified_seq, "checked_at": row.checked_at.isoformat() if row.checked_at else None,
            "problems_total": row.problems_total, "first_problem": row.first_problem}


def _check_chain_from(conn: Connection, start: Checkpoint, report: VerifyReport, progress: Progress | None) -> Checkpoint:
    _, (end_seq, end_hash) = walk(conn, report, (start.seq, start.hash), progress=progress)
    check_head(conn, (end_seq, end_hash), report)
    if start.seq:  # the checkpoint itself, which the walk from its hash does not read
        stored = conn.execute(select(ledger_events.c.hash).where(ledger_events.c.seq == start.seq)).scalar_one_or_none()
        if stored is None or bytes(stored) != start.hash:
            report.add(f"event {start.seq}: its hash is no longer the {start.hash.hex()} the checkpoint holds")
    return Checkpoint(end_seq, end_hash)


def _refunded_by_account(conn: Connection) -> dict[int, int]:
    """What each customer took back by refunds and disputes (its debt allowance)."""
    p = ledger_event_postings.c
    rows = conn.execute(
        select(p.event_seq, p.account_id, p.amount_nano_usd)
        .join(ledger_events, ledger_events.c.seq == p.event_seq)
        .where(ledger_events.c.event_type.in_(REFUND_EVENT_TYPES))
        .order_by(p.event_seq, p.leg)
    ).all()
    refunded: dict[int, int] = {}
    seen: set[int] = set()
    for seq, account_id, amount in rows:
        if seq not in seen:
            seen.add(seq)
            refunded[account_id] = refunded.get(account_id, 0) - amount
    return refunded


def _check_postings(conn: Connection, report: VerifyReport) -> None:
    for seq in conn.execute(_POSTINGS_OF_NO_EVENT).scalars():
        report.add(f"postings name event {seq}, which is not in the log")
    for seq, total in conn.execute(_EVENTS_NOT_SUMMING_TO_ZERO):
        report.add(f"event {seq}: postings sum to {total} nano-USD, not 0")
