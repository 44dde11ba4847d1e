"""Server-side console sessions: the cookie carries 256 random bits, the
database keeps only their SHA-256, the address signed in, and the two
expiries (idle and absolute). Signing in always makes a new session (the old
cookie's session, if any, ends), and signing out everywhere ends every session
of the address.

The CSRF token of a session is derived from its secret (a keyed hash no one
without the cookie can compute), so forms need no second store."""
from __future__ import annotations

import hashlib
import hmac
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import Column, Connection, Index, String, Table, delete, select, update

from app.limits import SESSION_ABSOLUTE_S, SESSION_IDLE_S, SESSION_TOUCH_INTERVAL_S
from ledger.limits import EMAIL_CHARS_MAX
from ledger.schema import BigId, Sha256, UTCDateTime, metadata, utc_now
from proxy.keys import key_sha256, new_secret

SESSION_PREFIX = "ss-par-"
CSRF_CONTEXT = b"paralon console csrf"

console_sessions = Table(
    "console_sessions",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("session_sha256", Sha256, nullable=False, unique=True),
    Column("email", String(EMAIL_CHARS_MAX), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("last_seen_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False),  # absolute: created_at + SESSION_ABSOLUTE_S
    Index("ix_console_sessions_email", "email"),
)


class Session(NamedTuple):
    id: int
    email: str
    secret: str

    @property
    def csrf_token(self) -> str:
        return csrf_token_of(self.secret)


def csrf_token_of(secret: str) -> str:
    return hmac.new(secret.encode(), CSRF_CONTEXT, hashlib.sha256).hexdigest()


def csrf_matches(session: Session, sent: object) -> bool:
    return isinstance(sent, str) and hmac.compare_digest(session.csrf_token, sent)


def start_session(conn: Connection, email: str, replacing: str | None = None, now: datetime | None = None) -> Session:
    """A new session for this address; the one `replacing` names (the cookie sent at sign-in) ends."""
    now = now or utc_now()
    if replacing:
        end_session(conn, replacing)
    secret = new_secret(SESSION_PREFIX)
    session_id = conn.execute(console_sessions.insert().values(
        session_sha256=key_sha256(secret), email=email, created_at=now, last_seen_at=now,
        expires_at=now + timedelta(seconds=SESSION_ABSOLUTE_S)).returning(console_sessions.c.id)).scalar_one()
    return Session(session_id, email, secret)


def find_session(conn: Connection, secret: str, now: datetime | None = None) -> Session | None:
    """The live session of this cookie, its last use written at most once a minute; else None."""
    if not secret.startswith(SESSION_PREFIX):
        return None
    now = now or utc_now()
    row = conn.execute(select(console_sessions.c.id, console_sessions.c.email, console_sessions.c.last_seen_at)
                       .where(console_sessions.c.session_sha256 == key_sha256(secret),
                              console_sessions.c.expires_at > now,
                              console_sessions.c.last_seen_at > now - timedelta(seconds=SESSION_IDLE_S))).first()
    if row is None:
        return None
    if now - row.last_seen_at >= timedelta(seconds=SESSION_TOUCH_INTERVAL_S):
        conn.execute(update(console_sessions).where(console_sessions.c.id == row.id).values(last_seen_at=now))
        conn.commit()
    return Session(row.id, row.email, secret)


def end_session(conn: Connection, secret: str) -> None:
    conn.execute(delete(console_sessions).where(console_sessions.c.session_sha256 == key_sha256(secret)))


def end_every_session(conn: Connection, email: str) -> int:
    return conn.execute(delete(console_sessions).where(console_sessions.c.email == email)).rowcount
