"""Accounts: customers and GPU owners, plus the platform's own and external counter-accounts."""
from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import Connection, func, select

from ledger import commands as cmd
from ledger.db import storage_of
from ledger.errors import InvalidInput, UnknownAccount, WrongAccountKind, a_or_an
from ledger.limits import ACCOUNT_NAME_CHARS_MAX, EMAIL_CHARS_MAX
from ledger.schema import account_balances, accounts, customer_holds, utc_now
from ledger.storage.base import in_chunks

_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


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


def valid_email(email: str) -> bool:
    return len(email) <= EMAIL_CHARS_MAX and _EMAIL.match(email) is not None


def create_account(conn: Connection, kind: str, name: str, email: str | None = None) -> int:
    """A customer or GPU-owner account (the platform's own accounts come with the schema)."""
    if kind not in (cmd.CUSTOMER, cmd.OWNER):
        raise InvalidInput(f"an account is a {cmd.CUSTOMER} or an {cmd.OWNER}, not {kind!r}")
    name = (name or "").strip()
    if not name or len(name) > ACCOUNT_NAME_CHARS_MAX:
        raise InvalidInput(f"a name of 1 to {ACCOUNT_NAME_CHARS_MAX} characters is required")
    if email is not None and not valid_email(email):
        raise InvalidInput(f"not an email address: {email!r}")
    account_id = conn.execute(
        accounts.insert().values(kind=kind, name=name, email=email, created_at=utc_now()).returning(accounts.c.id)
    ).scalar_one()
    conn.execute(account_balances.insert().values(account_id=account_id, balance_nano_usd=0, last_event_seq=0))
    if kind == cmd.CUSTOMER:
        conn.execute(customer_holds.insert().values(account_id=account_id, holds_placed_nano_usd=0))
    return account_id


def create_system_account(conn: Connection, code: str, name: str) -> int:
    """An external counter-account named by code (e.g. one per chain), made once."""
    found = conn.execute(select(accounts.c.id).where(accounts.c.system_code == code)).scalar()
    if found is not None:
        return found
    account_id = conn.execute(
        accounts.insert().values(kind="external", name=name, system_code=code, created_at=utc_now()).returning(accounts.c.id)
    ).scalar_one()
    conn.execute(account_balances.insert().values(account_id=account_id, balance_nano_usd=0, last_event_seq=0))
    return account_id


HELD_NANO_USD = func.coalesce(customer_holds.c.holds_placed_nano_usd, 0) - account_balances.c.holds_closed_nano_usd


def _books_query():
    return (
        select(accounts.c.id, accounts.c.kind, account_balances.c.balance_nano_usd, HELD_NANO_USD, account_balances.c.last_event_seq)
        .join(account_balances, account_balances.c.account_id == accounts.c.id)
        .outerjoin(customer_holds, customer_holds.c.account_id == accounts.c.id)
    )


def read_books(conn: Connection, account_ids: list[int]) -> dict[int, BalanceView]:
    """Kind, balance and active holds per account, in ONE statement.

    One statement is one snapshot: a settlement committing meanwhile is seen
    whole (credits lowered and its hold closed, both in one row) or not at all."""
    views = {}
    for chunk in in_chunks(account_ids):
        for r in conn.execute(_books_query().where(storage_of(conn).one_of(accounts.c.id, chunk))):
            views[r[0]] = BalanceView(r[0], r[1], r[2], int(r[3]), r[4])
    return views


def lock_customer_holds(conn: Connection, account_ids: list[int]) -> None:
    """Serialise hold placement per customer (id order, so two batches never deadlock)."""
    for chunk in in_chunks(account_ids):
        conn.execute(
            select(customer_holds.c.account_id)
            .where(storage_of(conn).one_of(customer_holds.c.account_id, chunk))
            .order_by(customer_holds.c.account_id)
            .with_for_update()
        ).all()


def read_balance(conn: Connection, account_id: int) -> BalanceView:
    view = read_books(conn, [account_id]).get(account_id)
    if view is None:
        raise UnknownAccount(f"account {account_id} does not exist")
    return view


def require_kind(conn: Connection, account_id: int, kinds: tuple[str, ...], rule: str) -> str:
    """The account's kind when it is one of `kinds`; otherwise a typed error that states `rule`."""
    kind = conn.execute(select(accounts.c.kind).where(accounts.c.id == account_id)).scalar()
    if kind is None:
        raise UnknownAccount(f"account {account_id} does not exist")
    if kind not in kinds:
        raise WrongAccountKind(f"{rule}; {account_id} is {a_or_an(kind)} account")
    return kind


def count_by_kind(conn: Connection) -> dict[str, int]:
    """Accounts of each kind (customer, owner, platform, external), 0 when none."""
    counts = dict.fromkeys((cmd.CUSTOMER, cmd.OWNER, cmd.PLATFORM, cmd.EXTERNAL), 0)
    counts.update(conn.execute(select(accounts.c.kind, func.count()).group_by(accounts.c.kind)).all())
    return counts


def page_of_books(conn: Connection, after_id: int, rows_max: int, account_id: int | None = None) -> list[tuple[str, str | None, BalanceView]]:
    """(name, email, balances) of the accounts after `after_id` in id order, at most `rows_max`
    (only `account_id` when given), each balance read with its holds in the one statement."""
    query = _books_query().add_columns(accounts.c.name, accounts.c.email).where(accounts.c.id > after_id)
    if account_id is not None:
        query = query.where(accounts.c.id == account_id)
    rows = conn.execute(query.order_by(accounts.c.id).limit(rows_max))
    return [(r.name, r.email, BalanceView(r[0], r[1], r[2], int(r[3]), r[4])) for r in rows]
