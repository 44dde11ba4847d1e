"""Verification from a checkpoint, cheap enough to run every few minutes.

`ledger.verify.verify` replays the whole log in Python. This proves the chain
only from the last event a previous run proved (its seq and hash are kept in
`ledger_verifications`), and checks every balance against the sum of its
postings in one aggregate the database runs, every event's postings summing
to zero in another, and the hold and spend-limit
counters as a full verification does. Run it on a snapshot connection.
"""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, select, text, update

from ledger.log import read_events
from ledger.schema import ledger_events, ledger_head, ledger_verifications, utc_now
from ledger.verify import VerifyReport, _check_event, _check_hold_counters, _check_spend_limits

# Each account's stored balance beside the sum of its postings; postings of no account.
_BALANCES_AGAINST_POSTINGS = text("""
SELECT b.account_id, b.balance_nano_usd, coalesce(p.total, 0) FROM account_balances b
LEFT JOIN (SELECT account_id, sum(amount_nano_usd) AS total FROM ledger_postings GROUP BY account_id) p
  ON p.account_id = b.account_id
WHERE b.balance_nano_usd <> coalesce(p.total, 0)
""")
_POSTINGS_OF_NO_ACCOUNT = text("""
SELECT DISTINCT p.account_id FROM ledger_postings p
WHERE NOT EXISTS (SELECT 1 FROM account_balances b WHERE b.account_id = p.account_id)
""")
_POSTINGS_OF_NO_EVENT = text("""
SELECT DISTINCT p.event_seq FROM ledger_postings p
WHERE NOT EXISTS (SELECT 1 FROM ledger_events e WHERE e.seq = p.event_seq) ORDER BY 1
""")

# The chain check sums the postings of the events it reads (those since the
# checkpoint); a posting added later to an older event is found only here.
_EVENTS_NOT_SUMMING_TO_ZERO = text("""
SELECT event_seq, sum(amount_nano_usd) FROM ledger_postings GROUP BY event_seq HAVING sum(amount_nano_usd) <> 0 ORDER BY 1
""")


@dataclass(frozen=True)
class Checkpoint:
    seq: int
    hash: bytes


def read_checkpoint(conn: Connection) -> Checkpoint:
    row = conn.execute(select(ledger_verifications.c.verified_seq, ledger_verifications.c.verified_hash)
                       .where(ledger_verifications.c.id == 1)).one()
    return Checkpoint(row.verified_seq, bytes(row.verified_hash))


def verify_since(conn: Connection, start: Checkpoint) -> tuple[VerifyReport, Checkpoint]:
    """The report, and how far the chain is now proven (`start` again if it failed)."""
    report = VerifyReport()
    end = _check_chain_from(conn, start, report)
    _check_balances(conn, report)
    _check_hold_counters(conn, report)
    _check_spend_limits(conn, report)
    return report, (end if report.ok else start)


def record(conn: Connection, report: VerifyReport, proven: Checkpoint) -> None:
    conn.execute(update(ledger_verifications).where(ledger_verifications.c.id == 1).values(
        verified_seq=proven.seq, verified_hash=proven.hash, checked_at=utc_now(), ok=report.ok,
        problems_total=report.problems_total, first_problem=report.problems[0] if report.problems else None))


def _check_chain_from(conn: Connection, start: Checkpoint, report: VerifyReport) -> Checkpoint:
    if start.seq:
        stored = conn.execute(select(ledger_events.c.hash).where(ledger_events.c.seq == start.seq)).scalar_one_or_none()
        if stored is None or bytes(stored) != start.hash:
            report.add(f"event {start.seq}: its hash is no longer the {start.hash.hex()} a previous verification proved")
    prev_hash, expected_seq = start.hash, start.seq + 1
    while page := read_events(conn, expected_seq - 1):
        for event in page:
            _check_event(event, expected_seq, prev_hash, report)
            report.events_checked += 1
            prev_hash, expected_seq = event.hash, event.seq + 1
    head = conn.execute(select(ledger_head.c.last_seq, ledger_head.c.last_hash).where(ledger_head.c.id == 1)).one()
    if (head.last_seq, bytes(head.last_hash)) != (expected_seq - 1, prev_hash):
        report.add(f"ledger_head says seq {head.last_seq}, the log ends at seq {expected_seq - 1} hash {prev_hash.hex()}")
    return Checkpoint(expected_seq - 1, prev_hash)


def _check_balances(conn: Connection, report: VerifyReport) -> None:
    report.accounts_checked = conn.execute(text("SELECT count(*) FROM account_balances")).scalar_one()
    for account_id, stored, posted in conn.execute(_BALANCES_AGAINST_POSTINGS):
        report.add(f"account {account_id}: balance {stored} nano-USD but its postings sum to {posted} "
                   f"(differs by {stored - int(posted)})")
    for account_id in conn.execute(_POSTINGS_OF_NO_ACCOUNT).scalars():
        report.add(f"postings name account {account_id}, which has no balance row")
    for seq in conn.execute(_POSTINGS_OF_NO_EVENT).scalars():
        report.add(f"postings name event {seq}, which is not in the log")
    for seq, total in conn.execute(_EVENTS_NOT_SUMMING_TO_ZERO):
        report.add(f"event {seq}: postings sum to {total} nano-USD, not 0")
