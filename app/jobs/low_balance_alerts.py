"""Low-balance alerts (beat's `low-balance-alerts`, every minute): one email to
each customer whose available balance (credits less holds, read from the
ledger's balances) is below the threshold it set (app/low_balance.py), once
per crossing.

An account alerted is marked (`low_balance_alerted_at`); the mark is cleared
by the first run that finds the balance back at or above the threshold (a
top-up), so the next fall below alerts again. A sender first claims the
account with a conditional UPDATE, as invoices' emails do (invoices/mail.py):
two runs at once never send the same alert. A send that fails releases the
claim and the next run tries again; a sender that dies between the SMTP
server's acceptance and the mark may send that alert once more after the
claim's timeout, never twice at once."""
from __future__ import annotations

import logging
import smtplib
from datetime import datetime, timedelta
from email.message import EmailMessage
from email.utils import make_msgid
from typing import NamedTuple

from sqlalchemy import Engine, or_, select, update

from app.limits import LOW_BALANCE_ALERTS_PER_RUN_MAX
from app.low_balance import usd_cents_text
from invoices.limits import MAIL_CLAIM_TIMEOUT_S
from invoices.mail import MailSettings, send_message
from invoices.render import cents_text
from ledger import commands as cmd
from ledger.accounts import HELD_NANO_USD, read_balance
from ledger.schema import account_balances, accounts, customer_holds, utc_now

log = logging.getLogger("paralon.low_balance_alerts")

AVAILABLE_NANO_USD = account_balances.c.balance_nano_usd - HELD_NANO_USD
THRESHOLD = accounts.c.low_balance_threshold_nano_usd


class RunReport(NamedTuple):
    sent: int  # emails the SMTP server accepted
    rearmed: int  # accounts back at or above their threshold, alerted again at the next crossing
    skipped: int  # claimed by another run, or back above before this one could send
    failed: int  # the mail server refused or was away: tried again at the next run


def run(engine: Engine, mail: MailSettings, *, accounts_max: int = LOW_BALANCE_ALERTS_PER_RUN_MAX) -> dict:
    """Re-arm the accounts back above their threshold, then alert those below it
    (at most `accounts_max`; the rest at the next run). Without a mail server
    nothing is sent and nothing is marked."""
    rearmed = rearm(engine)
    if not mail.host:
        return {**RunReport(0, rearmed, 0, 0)._asdict(), "skipped_reason": "mail is not configured"}
    outcomes = [alert(engine, mail, account_id) for account_id in due_accounts(engine, accounts_max)]
    return RunReport(outcomes.count("sent"), rearmed, outcomes.count("skipped"), outcomes.count("failed"))._asdict()


def _with_balances(query):
    return (query.join(account_balances, account_balances.c.account_id == accounts.c.id)
            .outerjoin(customer_holds, customer_holds.c.account_id == accounts.c.id)
            .where(accounts.c.kind == cmd.CUSTOMER, THRESHOLD.is_not(None)))


def rearm(engine: Engine) -> int:
    """Clear the mark of every account whose available balance is back at or above its threshold."""
    back_above = _with_balances(select(accounts.c.id)).where(accounts.c.low_balance_alerted_at.is_not(None),
                                                             AVAILABLE_NANO_USD >= THRESHOLD)
    with engine.begin() as conn:
        ids = conn.execute(back_above).scalars().all()
        if ids:
            conn.execute(update(accounts).where(accounts.c.id.in_(ids)).values(low_balance_alerted_at=None))
    return len(ids)


def due_accounts(engine: Engine, accounts_max: int) -> list[int]:
    """Accounts with an address, below their threshold and not alerted since they went below."""
    below = (_with_balances(select(accounts.c.id))
             .where(accounts.c.low_balance_alerted_at.is_(None), accounts.c.email.is_not(None), AVAILABLE_NANO_USD < THRESHOLD)
             .order_by(accounts.c.id).limit(accounts_max))
    with engine.connect() as conn:
        return list(conn.execute(below).scalars())


def alert(engine: Engine, mail: MailSettings, account_id: int, now: datetime | None = None) -> str:
    """'sent', 'skipped' (another sender holds it, it was alerted, or it is no longer below), or 'failed'."""
    now = now or utc_now()
    with engine.begin() as conn:
        claimed = conn.execute(
            update(accounts).where(accounts.c.id == account_id, THRESHOLD.is_not(None),
                                   accounts.c.low_balance_alerted_at.is_(None),
                                   or_(accounts.c.low_balance_alert_claimed_at.is_(None),
                                       accounts.c.low_balance_alert_claimed_at < now - timedelta(seconds=MAIL_CLAIM_TIMEOUT_S)))
            .values(low_balance_alert_claimed_at=now)
        ).rowcount
        if not claimed:
            return "skipped"
        account = conn.execute(select(accounts.c.name, accounts.c.email, THRESHOLD).where(accounts.c.id == account_id)).one()
        available = read_balance(conn, account_id).available_nano_usd
        if available >= account.low_balance_threshold_nano_usd:  # topped up since it was found below
            conn.execute(update(accounts).where(accounts.c.id == account_id).values(low_balance_alert_claimed_at=None))
            return "skipped"
    try:
        send_message(mail, _message(mail, account_id, account, available))
    except (OSError, smtplib.SMTPException) as exc:
        log.warning("low-balance alert of account %s not sent (the next run tries again): %s", account_id, exc)
        _release(engine, account_id)
        return "failed"
    except BaseException:
        _release(engine, account_id)
        raise
    with engine.begin() as conn:
        conn.execute(update(accounts).where(accounts.c.id == account_id)
                     .values(low_balance_alerted_at=utc_now(), low_balance_alert_claimed_at=None))
    return "sent"


def _release(engine: Engine, account_id: int) -> None:
    with engine.begin() as conn:
        conn.execute(update(accounts).where(accounts.c.id == account_id).values(low_balance_alert_claimed_at=None))


def _message(mail: MailSettings, account_id: int, account, available_nano_usd: int) -> EmailMessage:
    threshold = usd_cents_text(account.low_balance_threshold_nano_usd)
    message = EmailMessage()
    message["From"], message["To"] = mail.sender, account.email
    message["Subject"] = f"Paralon: your balance is below {threshold} USD"
    message["Message-ID"] = make_msgid(f"low-balance-{account_id}", domain=mail.sender.split("@")[-1])
    message.set_content(
        f"The available balance of {account.name} (account {account_id}) is {cents_text(available_nano_usd)} USD, "
        f"below the {threshold} USD you set for this alert.\n\n"
        "Requests are refused once nothing is left: add credits to keep them running. "
        "You are alerted again only after the balance has been back above the threshold.\n")
    return message
