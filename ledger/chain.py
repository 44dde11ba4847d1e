"""Walking the hash chain: each event's link, payload, hash and zero sum, and
the balances its postings add up to. `ledger.verify` walks the whole log,
`ledger.verify_ranges` splits it over processes, `ledger.verify_since` walks
from an anchor."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import orjson
from sqlalchemy import Connection

from ledger import events as ev
from ledger.anchors import read_head
from ledger.limits import LOG_PAGE_EVENTS_MAX, VERIFY_PROBLEMS_LISTED_MAX
from ledger.log import StoredEvent, read_events

Progress = Callable[[int], None]  # called with the number of events just processed
REFUND_EVENT_TYPES = ("CreditsRefunded", "CreditsFrozen")  # a customer's first leg is what it took back
Balances = dict[int, list[int]]  # account id -> [balance_nano_usd, seq of the last event posting to it]
ChainEnd = tuple[int, bytes]  # (seq, hash) of the last event walked; (0, GENESIS_HASH) before the first


@dataclass
class VerifyReport:
    events_checked: int = 0
    accounts_checked: int = 0
    problems: list[str] = field(default_factory=list)
    problems_total: int = 0
    # Refunds and disputes may leave a customer in debt, never by more than they took back.
    refunded_by_account: dict[int, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.problems_total == 0

    def add(self, problem: str) -> None:
        self.problems_total += 1
        if len(self.problems) < VERIFY_PROBLEMS_LISTED_MAX:
            self.problems.append(problem)

    def absorb(self, later: "VerifyReport") -> None:
        """Add what a walk of the next range of the log found."""
        self.events_checked += later.events_checked
        for problem in later.problems:
            self.add(problem)
        self.problems_total += later.problems_total - len(later.problems)
        for account_id, amount in later.refunded_by_account.items():
            self.refunded_by_account[account_id] = self.refunded_by_account.get(account_id, 0) + amount


def walk(conn: Connection, report: VerifyReport, start: ChainEnd = (0, ev.GENESIS_HASH), through_seq: int | None = None,
         progress: Progress | None = None) -> tuple[Balances, ChainEnd]:
    """Check every event after `start` (to `through_seq`, or the end) and add up
    its postings. Returns the balances of the range and where it ended."""
    balances: Balances = defaultdict(lambda: [0, 0])
    refunded = report.refunded_by_account
    prev_hash, expected_seq = start[1], start[0] + 1
    times = _TimeTexts()
    for page in _pages(conn, start[0], through_seq):
        for event in page:
            _check_event(event, expected_seq, prev_hash, times.text(event.recorded_at), report)
            if event.event_type in REFUND_EVENT_TYPES and event.postings:
                account_id, amount = event.postings[0]
                refunded[account_id] = refunded.get(account_id, 0) - amount
            for account_id, amount in event.postings:
                entry = balances[account_id]
                entry[0] += amount
                entry[1] = event.seq
            prev_hash, expected_seq = event.hash, event.seq + 1
        report.events_checked += len(page)
        if progress is not None:
            progress(len(page))
    return dict(balances), (expected_seq - 1, prev_hash)


def add_balances(into: Balances, later: Balances) -> None:
    """Balances of the next range of the log added to those before it."""
    for account_id, (amount, seq) in later.items():
        entry = into.setdefault(account_id, [0, 0])
        entry[0] += amount
        entry[1] = seq


def check_head(conn: Connection, end: ChainEnd, report: VerifyReport) -> None:
    """`ledger_head` names the event the walk of the log ended at."""
    head_seq, head_hash = read_head(conn)
    if (head_seq, head_hash) != end:
        report.add(f"ledger_head says seq {head_seq} hash {head_hash.hex()}, the log ends at seq {end[0]} hash {end[1].hex()}")


def _pages(conn: Connection, after_seq: int, through_seq: int | None) -> Iterator[list[StoredEvent]]:
    while through_seq is None or after_seq < through_seq:
        # A range's last page reads no further than its end (seqs are unique, so
        # at most through_seq - after_seq events lie in it; a gap leaves fewer).
        limit = LOG_PAGE_EVENTS_MAX if through_seq is None else min(LOG_PAGE_EVENTS_MAX, through_seq - after_seq)
        page = read_events(conn, after_seq, limit)
        if through_seq is not None:
            page = [event for event in page if event.seq <= through_seq]
        if not page:
            return
        yield page
        after_seq = page[-1].seq


class _TimeTexts:
    """`format_time` of each event's time; a batch's events share one, so the last is kept."""

    def __init__(self) -> None:
        self.moment, self.formatted = None, ""

    def text(self, moment) -> str:
        if moment != self.moment:
            self.moment, self.formatted = moment, ev.format_time(moment)
        return self.formatted


def _check_event(event: StoredEvent, expected_seq: int, prev_hash: bytes, recorded_at_text: str, report: VerifyReport) -> None:
    problems = []
    if event.seq != expected_seq:
        problems.append(f"expected seq {expected_seq}, the chain has a gap or a reorder")
    if event.prev_hash != prev_hash:
        problems.append(f"prev_hash {event.prev_hash.hex()} does not match the hash of the event before, {prev_hash.hex()}")
    try:
        canonical = ev.canonical_bytes(orjson.loads(event.payload_json)) == event.payload_json.encode()
    except (ValueError, TypeError):
        canonical = False
    if not canonical:
        problems.append("payload is not canonical JSON")
    computed = ev.event_hash(event.prev_hash, event.seq, event.event_type, event.idempotency_key, recorded_at_text, event.payload_json, event.postings)
    if computed != event.hash:
        problems.append(f"stored hash {event.hash.hex()} but the event and its postings hash to {computed.hex()}")
    total = sum([amount for _, amount in event.postings])
    if total != 0:
        problems.append(f"postings sum to {total} nano-USD, not 0")
    for problem in problems:  # named only when there is one: a million clean events build no text
        report.add(f"event {event.seq} ({event.event_type}): {problem}")
