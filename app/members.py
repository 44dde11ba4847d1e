"""People: members of accounts, each with a role, who sign in to the console
by email (app/console/). A member acts with the rights of the management
token role its member role maps to, so the console can do nothing the
management API does not let that role do.

customer_admin   a customer account: keys, top-ups, usage, documents (role `customer`)
customer_viewer  a customer account, read-only (role `viewer`)
accountant       a customer account's documents, read-only (role `accountant`)
owner            an owner account: its workers and earnings (role `owner`)
platform_admin   the platform: every account (role `admin`)
"""
from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import BigInteger, Column, Connection, ForeignKey, Index, String, Table, UniqueConstraint, delete, select

from app.limits import MEMBER_ROLE_CHARS_MAX
from app.tokens import ACCOUNT_KIND_OF_ROLE, ACCOUNTANT, ADMIN, CUSTOMER, OWNER, VIEWER, Principal
from ledger import commands as cmd
from ledger.accounts import require_kind, valid_email
from ledger.errors import InvalidInput, a_or_an
from ledger.limits import EMAIL_CHARS_MAX
from ledger.schema import BigId, UTCDateTime, accounts, metadata, utc_now

CUSTOMER_ADMIN, CUSTOMER_VIEWER, MEMBER_OWNER, MEMBER_ACCOUNTANT, PLATFORM_ADMIN = (
    "customer_admin", "customer_viewer", "owner", "accountant", "platform_admin")
PRINCIPAL_ROLE_OF_MEMBER = {CUSTOMER_ADMIN: CUSTOMER, CUSTOMER_VIEWER: VIEWER, MEMBER_ACCOUNTANT: ACCOUNTANT,
                            MEMBER_OWNER: OWNER, PLATFORM_ADMIN: ADMIN}
MEMBER_ROLES = tuple(PRINCIPAL_ROLE_OF_MEMBER)
# The role an account's own email gets when the account is created with one.
FIRST_MEMBER_ROLE = {cmd.CUSTOMER: CUSTOMER_ADMIN, cmd.OWNER: MEMBER_OWNER, cmd.PLATFORM: PLATFORM_ADMIN}

members = Table(
    "members",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("email", String(EMAIL_CHARS_MAX), nullable=False),  # lower case: one person, one address
    Column("role", String(MEMBER_ROLE_CHARS_MAX), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    UniqueConstraint("account_id", "email", name="uq_members_account_email"),
    Index("ix_members_email", "email"),
)


class Membership(NamedTuple):
    member_id: int
    account_id: int
    email: str
    role: str

    def principal(self) -> Principal:
        return Principal(None, self.account_id, PRINCIPAL_ROLE_OF_MEMBER[self.role], self.member_id)

    def as_dict(self) -> dict:
        return {"id": self.member_id, "account_id": self.account_id, "email": self.email, "role": self.role}


def normal_email(email: object) -> str:
    if not isinstance(email, str) or not valid_email(email.strip()):
        raise InvalidInput(f"not an email address: {email!r}")
    return email.strip().lower()


def add_member(conn: Connection, account_id: int, email: object, role: object) -> Membership:
    """A person joins an account. Their role must suit the account's kind; a person already
    a member of it is refused (change a role by removing and adding)."""
    if role not in MEMBER_ROLES:
        raise InvalidInput(f"role must be one of {', '.join(MEMBER_ROLES)}, got {role!r}")
    address = normal_email(email)
    kind = ACCOUNT_KIND_OF_ROLE[PRINCIPAL_ROLE_OF_MEMBER[role]]
    require_kind(conn, account_id, (kind,), f"{a_or_an(role)} is a member of {a_or_an(kind)} account")
    if conn.execute(select(members.c.id).where(members.c.account_id == account_id, members.c.email == address)).first():
        raise InvalidInput(f"{address} is already a member of account {account_id}")
    member_id = conn.execute(members.insert().values(account_id=account_id, email=address, role=role, created_at=utc_now())
                             .returning(members.c.id)).scalar_one()
    return Membership(member_id, account_id, address, role)


def add_first_member(conn: Connection, account_id: int, kind: str, email: str | None) -> None:
    """The email an account is created with is its first member."""
    if email is not None and kind in FIRST_MEMBER_ROLE:
        add_member(conn, account_id, email, FIRST_MEMBER_ROLE[kind])


def list_members(conn: Connection, account_id: int) -> list[Membership]:
    rows = conn.execute(select(members.c.id, members.c.account_id, members.c.email, members.c.role)
                        .where(members.c.account_id == account_id).order_by(members.c.id))
    return [Membership(*row) for row in rows]


def remove_member(conn: Connection, account_id: int, email: object) -> Membership:
    """Removes the membership; their console sessions for the account end with it (they are
    checked against the memberships at every page)."""
    address = normal_email(email)
    found = [m for m in list_members(conn, account_id) if m.email == address]
    if not found:
        raise InvalidInput(f"{address} is not a member of account {account_id}")
    conn.execute(delete(members).where(members.c.id == found[0].member_id))
    return found[0]


def memberships_of(conn: Connection, email: str) -> list[Membership]:
    rows = conn.execute(select(members.c.id, members.c.account_id, members.c.email, members.c.role)
                        .where(members.c.email == email).order_by(members.c.account_id))
    return [Membership(*row) for row in rows]


def is_member(conn: Connection, email: str) -> bool:
    return conn.execute(select(members.c.id).where(members.c.email == email).limit(1)).first() is not None


def account_names(conn: Connection, account_ids: list[int]) -> dict[int, str]:
    return dict(conn.execute(select(accounts.c.id, accounts.c.name).where(accounts.c.id.in_(account_ids))).all())


def members_of_accounts(conn: Connection, account_ids: list[int]) -> dict[int, list[Membership]]:
    rows = conn.execute(select(members.c.id, members.c.account_id, members.c.email, members.c.role)
                        .where(members.c.account_id.in_(account_ids)).order_by(members.c.id))
    found: dict[int, list[Membership]] = {}
    for row in rows:
        found.setdefault(row.account_id, []).append(Membership(*row))
    return found
