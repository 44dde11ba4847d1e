"""Management tokens: who may do what through the management API.

customer    its own account: API keys, top-ups, usage
viewer      its own (customer) account, read-only: balances, keys, usage, documents
accountant  its own (customer) account, read-only: invoices, statements, exports
owner       its own (owner) account: its workers and earnings
admin       the platform: every account
"""
from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import BigInteger, Column, Connection, ForeignKey, String, Table, select

from app.limits import ROLE_CHARS_MAX
from ledger import commands as cmd
from ledger.accounts import require_kind
from ledger.errors import InvalidInput, a_or_an
from ledger.schema import BigId, Sha256, UTCDateTime, metadata, utc_now
from proxy.keys import key_sha256, new_secret, revoke_secret
from proxy.limits import KEY_PREFIX_CHARS_MAX, KEY_PREFIX_SHOWN_CHARS

TOKEN_PREFIX = "pt-par-"
CUSTOMER, VIEWER, ACCOUNTANT, OWNER, ADMIN = "customer", "viewer", "accountant", "owner", "admin"
ROLES = (CUSTOMER, VIEWER, ACCOUNTANT, OWNER, ADMIN)
# The kind of account each role acts for.
ACCOUNT_KIND_OF_ROLE = {CUSTOMER: cmd.CUSTOMER, VIEWER: cmd.CUSTOMER, ACCOUNTANT: cmd.CUSTOMER, OWNER: cmd.OWNER,
                        ADMIN: cmd.PLATFORM}

# Like API keys: shown once, kept as SHA-256 of 256 random bits.
management_tokens = Table(
    "management_tokens",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("role", String(ROLE_CHARS_MAX), nullable=False),
    Column("token_sha256", Sha256, nullable=False, unique=True),
    Column("token_prefix", String(KEY_PREFIX_CHARS_MAX), nullable=False),  # shown like an API key's
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime),
)


class Principal(NamedTuple):
    """Who acts: a management token, or a console member (app/members.py) with the same rights."""

    token_id: int | None
    account_id: int
    role: str
    member_id: int | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN

    @property
    def actor(self) -> str:
        """Who it is, in records: `token 7` or `member 3`."""
        return f"token {self.token_id}" if self.member_id is None else f"member {self.member_id}"


def create_token(conn: Connection, account_id: int, role: str) -> tuple[int, str]:
    """Returns (id, token); the token itself is never stored and cannot be shown again."""
    if role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    require_kind(conn, account_id, (ACCOUNT_KIND_OF_ROLE[role],), f"{a_or_an(role)} token acts for {a_or_an(ACCOUNT_KIND_OF_ROLE[role])} account")
    token = new_secret(TOKEN_PREFIX)
    token_id = conn.execute(
        management_tokens.insert()
        .values(account_id=account_id, role=role, token_sha256=key_sha256(token),
                token_prefix=token[:KEY_PREFIX_SHOWN_CHARS], created_at=utc_now())
        .returning(management_tokens.c.id)
    ).scalar_one()
    return token_id, token


def revoke_token(conn: Connection, token_id: int) -> None:
    revoke_secret(conn, management_tokens, token_id, "management token")


def find_token(conn: Connection, token: str) -> Principal | None:
    """The live token this text is, or None (unknown, revoked, or not a management token)."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    row = conn.execute(
        select(management_tokens.c.id, management_tokens.c.account_id, management_tokens.c.role)
        .where(management_tokens.c.token_sha256 == key_sha256(token), management_tokens.c.revoked_at.is_(None))
    ).first()
    return Principal(*row) if row else None
