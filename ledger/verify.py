"""Proof after the fact: the chain, every zero sum, and balances equal to a replay."""
from __future__ import annotations

from collections import defaultdict

from sqlalchemy import Connection, bindparam, func, select, update

from ledger import commands as cmd
from ledger import spend_limits
from ledger.accounts import read_books
from ledger.chain import Progress, VerifyReport, check_head
from ledger.log import iter_postings, last_seq
from ledger.verify_ranges import walk_log
from ledger.schema import account_balances, accounts, customer_holds, holds, ledger_events, ledger_head, ledger_postings, spend_limit_holds

BALANCE_GUARD_TRIGGER = "account_balances_guard"  # migration 0013


def count_events(conn: Connection) -> int:
    return conn.execute(select(func.count()).select_from(ledger_events)).scalar_one()


def replay_balances(conn: Connection, report: VerifyReport | None = None, progress: Progress | None = None,
                    processes: int | None = 1) -> dict[int, tuple[int, int]]:
    """Balances (and the last event touching each account) from the first event on,
    checking the chain and the zero sums when a report is given (in `processes`
    processes: `verify_ranges.walk_log`)."""
    if report is None:
        return _replay_postings(conn, progress)
    balances, end = walk_log(conn, report, progress, processes)
    check_head(conn, end, report)
    return {a: (v[0], v[1]) for a, v in balances.items()}


def _replay_postings(conn: Connection, progress: Progress | None) -> dict[int, tuple[int, int]]:
    """Balances from the postings alone, in order: a rebuild trusts the chain
    (`verify` proves it) and need not read the events' payloads and hashes."""
    balances: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    through_seq = last_seq(conn)
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


def verify(conn: Connection, progress: Progress | None = None, processes: int | None = 1) -> VerifyReport:
    report = VerifyReport()
    replayed = replay_balances(conn, report, progress, processes)
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
            [{"id": a, "balance": balance, "seq": seq} for a in account_ids for balance, seq in [replayed.get(a, (0, 0))]],
        )
    if guarded:
        conn.exec_driver_sql(f"ALTER TABLE account_balances ENABLE TRIGGER {BALANCE_GUARD_TRIGGER}")
    return len(account_ids)

