"""Small Given-steps and a snapshot of every balance, to prove nothing moved."""
from __future__ import annotations

import uuid

from sqlalchemy import func, select

from ledger import commands as cmd
from ledger.service import append_now
from ledger.schema import account_balances, holds, ledger_events, ledger_postings


def key(prefix: str = "k") -> str:
    return f"{prefix}:{uuid.uuid4().hex}"


def customer_with(ledger, amount_nano_usd: int) -> int:
    account = ledger.create_account(cmd.CUSTOMER, "customer", "c@example.com")
    if amount_nano_usd:
        ledger.append(cmd.GrantCredits(account, amount_nano_usd, "test credits", key("grant")))
    return account


def money_snapshot(engine) -> dict:
    """Every balance, the log length, the posting count and the active holds."""
    with engine.connect() as conn:
        return {
            "balances": dict(conn.execute(select(account_balances.c.account_id, account_balances.c.balance_nano_usd)).all()),
            "events": conn.execute(select(func.count()).select_from(ledger_events)).scalar_one(),
            "postings": conn.execute(select(func.count()).select_from(ledger_postings)).scalar_one(),
            "active_holds": conn.execute(select(func.count()).select_from(holds)).scalar_one(),
        }


def keep_granting(engine, account: int, stop) -> int:
    """Grant 1 nano-USD again and again until `stop` is set; how many were appended."""
    appended = 0
    while not stop.is_set():
        append_now(engine, cmd.GrantCredits(account, 1, "more", key("grant")))
        appended += 1
    return appended
