"""Passwordless sign-in: an emailed link that works once, within 15 minutes.

A request is answered the same way whether or not the address belongs to a
member; only a member's request makes a link. Every request is recorded (the
address, the caller's IP), so the two rate limits count known and unknown
addresses alike, and the link itself is stored only as its SHA-256."""
from __future__ import annotations

import logging
import smtplib
from dataclasses import dataclass
from datetime import datetime, timedelta
from email.message import EmailMessage

from sqlalchemy import Column, Connection, Index, String, Table, func, select, update

from app.limits import (
    IP_ADDRESS_CHARS_MAX,
    SIGN_IN_LINK_TTL_MINUTES,
    SIGN_IN_LINK_TTL_S,
    SIGN_IN_LINKS_PER_ADDRESS_MAX,
    SIGN_IN_REQUESTS_PER_IP_MAX,
    SIGN_IN_WINDOW_S,
)
from app.members import is_member, normal_email
from invoices.limits import SMTP_TIMEOUT_S
from invoices.mail import MailSettings
from ledger.errors import InvalidInput
from ledger.limits import EMAIL_CHARS_MAX
from ledger.schema import BigId, Sha256, UTCDateTime, metadata, utc_now
from proxy.keys import key_sha256, new_secret

LINK_PREFIX = "sl-par-"
OPERATOR_IP = "operator"  # where an operator's link was asked for: not a network address
log = logging.getLogger("paralon.console")

sign_in_requests = Table(
    "sign_in_requests",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("email", String(EMAIL_CHARS_MAX), nullable=False),
    Column("ip_address", String(IP_ADDRESS_CHARS_MAX), nullable=False),
    Column("link_sha256", Sha256, unique=True),  # NULL: the address is no member's, no link was made
    Column("requested_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False),
    Column("used_at", UTCDateTime),
    Index("ix_sign_in_requests_email_time", "email", "requested_at"),
    Index("ix_sign_in_requests_ip_time", "ip_address", "requested_at"),
)


@dataclass(frozen=True)
class ConsoleSettings:
    public_url: str  # where emailed links point (PARALON_PUBLIC_URL)
    mail: MailSettings


class RateLimited(Exception):
    """Too many sign-in requests from this address or IP within the window."""


def request_link(conn: Connection, email: object, ip_address: str, now: datetime | None = None) -> tuple[str, str] | None:
    """(address, link token) for a member, None for anyone else; `RateLimited` past either limit.
    The caller mails the token after commit and answers the same in every case."""
    now = now or utc_now()
    address = normal_email(email)
    since = now - timedelta(seconds=SIGN_IN_WINDOW_S)
    if (_count(conn, sign_in_requests.c.ip_address == ip_address[:IP_ADDRESS_CHARS_MAX], since) >= SIGN_IN_REQUESTS_PER_IP_MAX
            or _count(conn, sign_in_requests.c.email == address, since) >= SIGN_IN_LINKS_PER_ADDRESS_MAX):
        raise RateLimited("too many sign-in requests: try again in a few minutes")
    token = _record(conn, address, ip_address, now, is_member(conn, address))
    return (address, token) if token else None


def operator_link(conn: Connection, email: str) -> str:
    """A link for a member, made by whoever runs the service (the demo prints it): no rate limit."""
    address = normal_email(email)
    if not is_member(conn, address):
        raise InvalidInput(f"{address} is no member of any account")
    return _record(conn, address, OPERATOR_IP, utc_now(), True)


def _record(conn: Connection, address: str, ip_address: str, now: datetime, with_link: bool) -> str | None:
    token = new_secret(LINK_PREFIX) if with_link else None
    conn.execute(sign_in_requests.insert().values(
        email=address, ip_address=ip_address[:IP_ADDRESS_CHARS_MAX], link_sha256=key_sha256(token) if token else None,
        requested_at=now, expires_at=now + timedelta(seconds=SIGN_IN_LINK_TTL_S)))
    return token


def _count(conn: Connection, where, since: datetime) -> int:
    return conn.execute(select(func.count()).select_from(sign_in_requests)
                        .where(where, sign_in_requests.c.requested_at >= since)).scalar_one()


def redeem_link(conn: Connection, token: str, now: datetime | None = None) -> str | None:
    """The address a live, unused link was mailed to, marking it used (once, whoever races); else None."""
    if not token.startswith(LINK_PREFIX):
        return None
    now = now or utc_now()
    row = conn.execute(
        update(sign_in_requests)
        .where(sign_in_requests.c.link_sha256 == key_sha256(token), sign_in_requests.c.used_at.is_(None),
               sign_in_requests.c.expires_at > now)
        .values(used_at=now).returning(sign_in_requests.c.email)
    ).first()
    return row.email if row else None


def deliver_link(settings: MailSettings, address: str, url: str) -> str:
    """Mail the link; with no mail server configured, log it (the embedded demo prints it)."""
    if not settings.host:
        log.warning("no mail server configured: sign-in link for %s: %s", address, url)
        return "logged"
    message = EmailMessage()
    message["From"], message["To"], message["Subject"] = settings.sender, address, "Your Paralon sign-in link"
    message.set_content(f"Sign in to the Paralon console:\n\n{url}\n\n"
                        f"The link works once, within {SIGN_IN_LINK_TTL_MINUTES} minutes. "
                        "If you did not ask for it, ignore this message.\n")
    with smtplib.SMTP(settings.host, settings.port, timeout=SMTP_TIMEOUT_S) as smtp:
        if settings.user:
            smtp.starttls()
            smtp.login(settings.user, settings.password or "")
        smtp.send_message(message)
    return "sent"
