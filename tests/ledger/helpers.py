"""Small Given-steps and a snapshot of every balance, to prove nothing moved."""
from __future__ import annotations

import uuid

from sqlalchemy import func, inspect, select

from ledger import commands as cmd
from ledger.service import append_now
from ledger.schema import account_balances, holds, ledger_event_postings, ledger_events, ledger_head, ledger_postings
from tests.support.harness import wait_for


def key(prefix: str = "k") -> str:
    return f"{prefix}:{uuid.uuid4().hex}"


def customer_with(ledger, amount_nano_usd: int) -> int:
    account = ledger.create_account(cmd.CUSTOMER, "customer", "c@example.com")
    if amount_nano_usd:
        ledger.append(cmd.GrantCredits(account, amount_nano_usd, "test credits", key("grant")))
    return account


def money_snapshot(engine) -> dict:
    """Every balance, the log length, the posting count (rows and legs in event rows,
    or rows alone before migration 0031) and the active holds."""
    with engine.connect() as conn:
        return {
            "balances": dict(conn.execute(select(account_balances.c.account_id, account_balances.c.balance_nano_usd)).all()),
            "events": conn.execute(select(func.count()).select_from(ledger_events)).scalar_one(),
            "postings": conn.execute(select(func.count()).select_from(
                ledger_event_postings if ledger_event_postings.name in inspect(conn).get_view_names() else ledger_postings)).scalar_one(),
            "active_holds": conn.execute(select(func.count()).select_from(holds)).scalar_one(),
        }


def postings_in_event_row(engine) -> bool:
    """Whether this database's appends put postings in their event's row (migration 0031)."""
    with engine.connect() as conn:
        return conn.execute(select(ledger_head.c.postings_in_event_row)).scalar_one()


def leg_changed(engine, seq: int, leg: int, delta_nano_usd: int) -> str:
    """A superuser's statement adding to one leg's amount, where this database keeps it."""
    if postings_in_event_row(engine):
        return f"UPDATE ledger_events SET posting_amounts_nano_usd[{leg + 1}] = posting_amounts_nano_usd[{leg + 1}] + {delta_nano_usd} WHERE seq = {seq}"
    return f"UPDATE ledger_postings SET amount_nano_usd = amount_nano_usd + {delta_nano_usd} WHERE event_seq = {seq} AND leg = {leg}"


def leg_removed(engine, seq: int, leg: int) -> str:
    """A superuser's statement removing one leg of an event, where this database keeps it."""
    if postings_in_event_row(engine):
        return ("UPDATE ledger_events SET "
                + ", ".join(f"{column} = {column}[1:{leg}] || {column}[{leg + 2}:]" for column in ("posting_account_ids", "posting_amounts_nano_usd"))
                + f" WHERE seq = {seq}")
    return f"DELETE FROM ledger_postings WHERE event_seq = {seq} AND leg = {leg}"


def keep_granting(engine, account: int, stop) -> int:
    """Grant 1 nano-USD again and again until `stop` is set; how many were appended."""
    appended = 0
    while not stop.is_set():
        append_now(engine, cmd.GrantCredits(account, 1, "more", key("grant")))
        appended += 1
    return appended


def wait_until_a_session_waits_for_a_lock(engine) -> None:
    """Returns once a session of the test's database waits for a lock (PostgreSQL)."""
    wait_for(lambda: _lock_waits(engine), timeout_s=30, interval_s=0.01)


def _lock_waits(engine) -> int:
    with engine.connect() as watcher:
        return watcher.exec_driver_sql("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                       "AND wait_event_type = 'Lock'").scalar_one()
