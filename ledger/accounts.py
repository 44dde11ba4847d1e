"""Accounts: customers and GPU owners, plus the platform's own and external counter-accounts."""
from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import Connection, func, select

from ledger import commands as cmd
from ledger.errors import InvalidInput, UnknownAccount
from ledger.schema import account_balances, accounts, hold_locks, holds, utc_now

NAME_LENGTH_MAX = 200
EMAIL_LENGTH_MAX = 320
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
SYSTEM_ACCOUNTS = {
    cmd.PLATFORM_REVENUE_ACCOUNT: (cmd.PLATFORM, "Platform revenue"),
    cmd.GRANTS_ACCOUNT: (cmd.EXTERNAL, "Credits granted by operators"),
    cmd.ADJUSTMENTS_ACCOUNT: (cmd.EXTERNAL, "Operator adjustments"),
}


@dataclass(frozen=True, slots=True)
class BalanceView:
    account_id: int
    kind: str
    balance_nano_usd: int  # credits for a customer, earnings for an owner
    held_nano_usd: int
    last_event_seq: int

    @property
    def available_nano_usd(self) -> int:
        return self.balance_nano_usd - self.held_nano_usd


def create_account(conn: Connection, kind: str, name: str, email: str | None = None, system_code: str | None = None) -> int:
    if kind not in cmd.ACCOUNT_KINDS:
        raise InvalidInput(f"account kind must be one of {', '.join(cmd.ACCOUNT_KINDS)}")
    if system_code is None and kind not in (cmd.CUSTOMER, cmd.OWNER):
        raise InvalidInput("only customer and owner accounts are created by hand")
    name = (name or "").strip()
    if not name or len(name) > NAME_LENGTH_MAX:
        raise InvalidInput(f"a name of 1 to {NAME_LENGTH_MAX} characters is required")
    if email is not None and (len(email) > EMAIL_LENGTH_MAX or not _EMAIL.match(email)):
        raise InvalidInput(f"not an email address: {email!r}")
    account_id = conn.execute(
        accounts.insert().values(kind=kind, name=name, email=email, system_code=system_code, created_at=utc_now()).returning(accounts.c.id)
    ).scalar_one()
    conn.execute(account_balances.insert().values(account_id=account_id, balance_nano_usd=0, last_event_seq=0))
    if kind == cmd.CUSTOMER:
        conn.execute(hold_locks.insert().values(account_id=account_id))
    return account_id


def ensure_system_accounts(conn: Connection) -> None:
    existing = set(conn.execute(select(accounts.c.system_code).where(accounts.c.system_code.is_not(None))).scalars())
    for code, (kind, name) in SYSTEM_ACCOUNTS.items():
        if code not in existing:
            create_account(conn, kind, name, system_code=code)


def get_account(conn: Connection, account_id: int):
    row = conn.execute(select(accounts).where(accounts.c.id == account_id)).first()
    if row is None:
        raise UnknownAccount(f"account {account_id} does not exist")
    return row


def read_balance(conn: Connection, account_id: int) -> BalanceView:
    active_held = (
        select(func.coalesce(func.sum(holds.c.amount_nano_usd), 0))
        .where(holds.c.account_id == accounts.c.id, holds.c.state == "active")
        .scalar_subquery()
    )
    row = conn.execute(
        select(accounts.c.kind, account_balances.c.balance_nano_usd, account_balances.c.last_event_seq, active_held)
        .join(account_balances, account_balances.c.account_id == accounts.c.id)
        .where(accounts.c.id == account_id)
    ).first()
    if row is None:
        raise UnknownAccount(f"account {account_id} does not exist")
    return BalanceView(account_id, row[0], row[1], int(row[3]), row[2])
