"""Proof after the fact: the chain, every zero sum, and balances equal to a replay."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import orjson
from sqlalchemy import Connection, bindparam, func, select, update

from ledger import commands as cmd
from ledger import events as ev
from ledger import spend_limits
from ledger.accounts import read_books
from ledger.anchors import read_head
from ledger.limits import LOG_PAGE_EVENTS_MAX, VERIFY_PROBLEMS_LISTED_MAX
from ledger.log import iter_postings, read_events
from ledger.schema import account_balances, accounts, customer_holds, holds, ledger_events, ledger_head, ledger_postings, spend_limit_holds

BALANCE_GUARD_TRIGGER = "account_balances_guard"  # migration 0013
Progress = Callable[[int], None]  # called with the number of events just processed
REFUND_EVENT_TYPES = ("CreditsRefunded", "CreditsFrozen")  # a customer's first leg is what it took back


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


def count_events(conn: Connection) -> int:
    return conn.execute(select(func.count()).select_from(ledger_events)).scalar_one()


def replay_balances(conn: Connection, report: VerifyReport | None = None, progress: Progress | None = None) -> dict[int, tuple[int, int]]:
    """Balances (and the last event touching each account) from the first event on,
    checking the chain and the zero sums when a report is given."""
    if report is None:
        return _replay_postings(conn, progress)
    balances: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    refunded = report.refunded_by_account

    def replay(event) -> None:
        if event.event_type in REFUND_EVENT_TYPES and event.postings:
            account_id, amount = event.postings[0]
            refunded[account_id] = refunded.get(account_id, 0) - amount
        for account_id, amount in event.postings:
            entry = balances[account_id]
            entry[0] += amount
            entry[1] = event.seq

    check_chain(conn, report, progress, each=replay)
    return {a: (v[0], v[1]) for a, v in balances.items()}


def check_chain(conn: Connection, report: VerifyReport, progress: Progress | None = None,
                start: tuple[int, bytes] = (0, ev.GENESIS_HASH), each: Callable | None = None) -> tuple[int, bytes]:
    """Walk the log from the event after `start` (seq, its hash) to the head,
    checking each event's link, payload, hash and zero sum, and `ledger_head`;
    `each(event)` sees every event. Returns the (seq, hash) the walk ended at."""
    prev_hash, expected_seq = start[1], start[0] + 1
    times = _TimeTexts()
    while page := read_events(conn, expected_seq - 1, LOG_PAGE_EVENTS_MAX):
        for event in page:
            _check_event(event, expected_seq, prev_hash, times.text(event.recorded_at), report)
            if each is not None:
                each(event)
            prev_hash, expected_seq = event.hash, event.seq + 1
        report.events_checked += len(page)
        if progress is not None:
            progress(len(page))
    check_head(conn, expected_seq - 1, prev_hash, report)
    return expected_seq - 1, prev_hash


def _replay_postings(conn: Connection, progress: Progress | None) -> dict[int, tuple[int, int]]:
    """Balances from the postings alone, in order: a rebuild trusts the chain
    (`verify` proves it) and need not read the events' payloads and hashes."""
    balances: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    through_seq = conn.execute(select(func.max(ledger_events.c.seq))).scalar_one() or 0
    shown = 0
    for page in iter_postings(conn, through_seq):
        for seq, account_id, amount in page:
            entry = balances[account_id]
            entry[0] += amount
            entry[1] = seq
        if progress is not None and page:
            progress(page[-1][0] - shown)
            shown = page[-1][0]
    if progress is not None:
        progress(through_seq - shown)
    return {a: (v[0], v[1]) for a, v in balances.items()}


class _TimeTexts:
    """`format_time` of each event's time; a batch's events share one, so the last is kept."""

    def __init__(self) -> None:
        self.moment, self.formatted = None, ""

    def text(self, moment) -> str:
        if moment != self.moment:
            self.moment, self.formatted = moment, ev.format_time(moment)
        return self.formatted


def check_head(conn: Connection, last_seq: int, last_hash: bytes, report: VerifyReport) -> None:
    """`ledger_head` names the event the walk of the log ended at."""
    head_seq, head_hash = read_head(conn)
    if (head_seq, head_hash) != (last_seq, last_hash):
        report.add(f"ledger_head says seq {head_seq} hash {head_hash.hex()}, the log ends at seq {last_seq} hash {last_hash.hex()}")


def _check_event(event, expected_seq: int, prev_hash: bytes, recorded_at_text: str, report: VerifyReport) -> None:
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


def verify(conn: Connection, progress: Progress | None = None) -> VerifyReport:
    report = VerifyReport()
    replayed = replay_balances(conn, report, progress)
    _check_balances(conn, {account_id: balance for account_id, (balance, _) in replayed.items()}, report)
    _check_hold_counters(conn, report)
    _check_spend_limits(conn, report)
    return report


def _check_balances(conn: Connection, replayed: dict[int, int], report: VerifyReport) -> None:
    """Each balance equals its replay, no non-negative account is below zero, and
    postings name only accounts that exist."""
    rows = conn.execute(
        select(accounts.c.id, accounts.c.kind, account_balances.c.balance_nano_usd).outerjoin(account_balances, account_balances.c.account_id == accounts.c.id)
    ).all()
    known = set()
    for account_id, kind, stored in rows:
        known.add(account_id)
        report.accounts_checked += 1
        expected = replayed.get(account_id, 0)
        if stored is None:
            report.add(f"account {account_id}: has no balance row")
        elif stored != expected:
            report.add(f"account {account_id} ({kind}): balance {stored} nano-USD but a replay gives {expected} (differs by {stored - expected})")
        debt_allowed = report.refunded_by_account.get(account_id, 0) if kind == cmd.CUSTOMER else 0
        if kind in cmd.NON_NEGATIVE_KINDS and expected < -debt_allowed:
            report.add(f"account {account_id} ({kind}): replayed balance {expected} is below zero")
    for account_id in sorted(set(replayed) - known):
        report.add(f"postings name account {account_id}, which does not exist")


def _check_hold_counters(conn: Connection, report: VerifyReport) -> None:
    """Each customer's hold counters (placed minus closed) equal its active holds."""
    active = dict(
        conn.execute(
            select(holds.c.account_id, func.sum(holds.c.amount_nano_usd)).group_by(holds.c.account_id)
        ).all()
    )
    for view in read_books(conn, conn.execute(select(customer_holds.c.account_id)).scalars().all()).values():
        expected = int(active.get(view.account_id, 0))
        if view.held_nano_usd != expected:
            report.add(f"account {view.account_id}: hold counters say {view.held_nano_usd} nano-USD held, active holds sum to {expected}")


def _check_spend_limits(conn: Connection, report: VerifyReport) -> None:
    """Each spend limit's hold counters equal its active holds, and it was never overspent."""
    active = dict(conn.execute(
        select(holds.c.spend_limit_id, func.sum(holds.c.amount_nano_usd))
        .where(holds.c.spend_limit_id.is_not(None)).group_by(holds.c.spend_limit_id)
    ).all())
    ids = conn.execute(select(spend_limit_holds.c.limit_id)).scalars().all()
    for limit_id, view in sorted(spend_limits.read_limits(conn, ids).items()):
        expected = int(active.get(limit_id, 0))
        if view["held_nano_usd"] != expected:
            report.add(f"spend limit {limit_id}: hold counters say {view['held_nano_usd']} nano-USD held, active holds sum to {expected}")
        if view["spent_nano_usd"] > view["limit_nano_usd"]:
            report.add(f"spend limit {limit_id}: spent {view['spent_nano_usd']} nano-USD of its limit of {view['limit_nano_usd']}")


def rebuild_balances(conn: Connection, progress: Progress | None = None) -> int:
    """Replace the inline balances with a replay; holds the append lock meanwhile.
    On PostgreSQL only the owner role can: it lifts the balance guard (migration
    0013) for this transaction, since a repaired balance moves without an event."""
    conn.execute(select(ledger_head.c.last_seq).where(ledger_head.c.id == 1).with_for_update()).one()
    guarded = conn.dialect.name == "postgresql"
    if guarded:
        conn.exec_driver_sql(f"ALTER TABLE account_balances DISABLE TRIGGER {BALANCE_GUARD_TRIGGER}")
    replayed = replay_balances(conn, progress=progress)
    account_ids = conn.execute(select(account_balances.c.account_id)).scalars().all()
    if account_ids:  # one statement for every account (executemany)
        conn.execute(
            update(account_balances).where(account_balances.c.account_id == bindparam("id"))
            .values(balance_nano_usd=bindparam("balance"), last_event_seq=bindparam("seq")),
            [{"id": a, "balance": replayed.get(a, (0, 0))[0], "seq": replayed.get(a, (0, 0))[1]} for a in account_ids],
        )
    if guarded:
        conn.exec_driver_sql(f"ALTER TABLE account_balances ENABLE TRIGGER {BALANCE_GUARD_TRIGGER}")
    return len(account_ids)

