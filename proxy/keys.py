"""API keys for inference: shown once, stored as SHA-256, revocable."""
from __future__ import annotations

import hashlib
import secrets
from typing import NamedTuple

from sqlalchemy import Connection, select, text, update

from ledger import commands as cmd
from ledger import spend_limits
from ledger.accounts import require_kind
from ledger.db import is_postgres
from ledger.errors import InvalidInput
from ledger.money import require_positive
from ledger.schema import utc_now
from proxy.limits import KEY_PREFIX_SHOWN_CHARS, KEY_RANDOM_BYTES, NAME_CHARS_MAX
from proxy.schema import api_keys

KEY_PREFIX = "sk-par-"
REVOCATION_CHANNEL = "paralon_revocations"  # payload: "<table>:<id>"


class KeyGrant(NamedTuple):
    id: int
    account_id: int
    spend_limit_nano_usd: int | None

    @property
    def spend_limit_id(self) -> int | None:
        """The ledger's spend limit this key reserves against (its own id), if it has one."""
        return self.id if self.spend_limit_nano_usd is not None else None


def key_sha256(secret: str) -> bytes:
    """How API keys and management tokens are stored: 256 random bits need no slow hash."""
    return hashlib.sha256(secret.encode()).digest()


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def revoke_secret(conn: Connection, table, row_id: int, what: str) -> None:
    """Revoke a stored key or token (idempotent); an unknown id is an error.

    On PostgreSQL every `serve` process listening on REVOCATION_CHANNEL hears
    of it when this transaction commits (never before, never if it rolls back)
    and forgets the key at once (proxy/revocations.py)."""
    revoked = conn.execute(update(table).where(table.c.id == row_id, table.c.revoked_at.is_(None)).values(revoked_at=utc_now())).rowcount
    if not revoked and conn.execute(select(table.c.id).where(table.c.id == row_id)).first() is None:
        raise InvalidInput(f"{what} {row_id} does not exist")
    if is_postgres(conn):  # sent again for a key already revoked: a replica that missed it forgets it now
        conn.execute(text("SELECT pg_notify(:channel, :payload)"),
                     {"channel": REVOCATION_CHANNEL, "payload": revocation_payload(table.name, row_id)})


def revocation_payload(table_name: str, row_id: int) -> str:
    return f"{table_name}:{row_id}"


def parse_revocation(payload: str) -> tuple[str, int] | None:
    table_name, _, row_id = payload.partition(":")
    return (table_name, int(row_id)) if row_id.isdigit() else None


def create_key(conn: Connection, account_id: int, *, name: str | None = None,
               spend_limit_nano_usd: int | None = None) -> tuple[int, str]:
    """Returns (id, key); the key itself is never stored and cannot be shown again."""
    require_kind(conn, account_id, (cmd.CUSTOMER,), "API keys belong to customer accounts")
    if spend_limit_nano_usd is not None:
        require_positive(spend_limit_nano_usd, "spend limit")
    if name is not None:
        cmd.require_text(name, "a key name", NAME_CHARS_MAX)
    key = new_secret(KEY_PREFIX)
    key_id = conn.execute(
        api_keys.insert()
        .values(account_id=account_id, key_sha256=key_sha256(key), key_prefix=key[:KEY_PREFIX_SHOWN_CHARS],
                name=name, spend_limit_nano_usd=spend_limit_nano_usd, created_at=utc_now())
        .returning(api_keys.c.id)
    ).scalar_one()
    if spend_limit_nano_usd is not None:  # reserved in the ledger like a balance, under the key's id
        spend_limits.create_limit(conn, key_id, spend_limit_nano_usd)
    return key_id, key


def revoke_key(conn: Connection, key_id: int) -> None:
    revoke_secret(conn, api_keys, key_id, "API key")


def find_key(conn: Connection, key: str) -> KeyGrant | None:
    """The live key this text is, or None (unknown or revoked)."""
    if not key.startswith(KEY_PREFIX):
        return None
    row = conn.execute(
        select(api_keys.c.id, api_keys.c.account_id, api_keys.c.spend_limit_nano_usd)
        .where(api_keys.c.key_sha256 == key_sha256(key), api_keys.c.revoked_at.is_(None))
    ).first()
    return KeyGrant(*row) if row else None


def key_account(conn: Connection, key_id: int) -> int | None:
    return conn.execute(select(api_keys.c.account_id).where(api_keys.c.id == key_id)).scalar()


def list_keys(conn: Connection, account_id: int) -> list[dict]:
    rows = conn.execute(select(api_keys).where(api_keys.c.account_id == account_id).order_by(api_keys.c.id))
    return [
        {"id": r.id, "prefix": r.key_prefix, "name": r.name, "spend_limit_nano_usd": r.spend_limit_nano_usd,
         "created_at": r.created_at.isoformat(), "revoked": r.revoked_at is not None}
        for r in rows
    ]
