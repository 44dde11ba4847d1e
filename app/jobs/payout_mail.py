"""Mail to an owner's people when where they are paid changes: every member of
the account and its own address are told the old and the new destination and
when payouts start going to it, so a change they did not make is seen within
the cooldown. Sent from the outbox (the change's transaction wrote the task);
without a mail server it is logged and not sent."""
from __future__ import annotations

import logging
from email.message import EmailMessage
from email.utils import make_msgid

from sqlalchemy import Engine, select

from app.members import members_of_accounts
from app.payments.payouts import get_destination
from invoices.mail import MailSettings, send_message
from ledger.schema import accounts

log = logging.getLogger("paralon.payouts")


def destination_changed(engine: Engine, mail: MailSettings, owner_account_id: int, rail: str) -> int:
    """Mails the change of `rail`'s destination; returns how many addresses it went to."""
    with engine.connect() as conn:
        found = get_destination(conn, owner_account_id, rail)
        name, email = conn.execute(select(accounts.c.name, accounts.c.email).where(accounts.c.id == owner_account_id)).one()
        people = {m.email for m in members_of_accounts(conn, [owner_account_id]).get(owner_account_id, [])}
    people |= {email} if email else set()
    if found is None or not people:
        return 0
    if not mail.host:
        log.warning("the %s payout destination of account %s changed; mail is not configured, nobody was told", rail, owner_account_id)
        return 0
    message = EmailMessage()
    message["From"], message["To"] = mail.sender, ", ".join(sorted(people))
    message["Subject"] = f"Paralon: the {rail} payout destination of {name} changed"
    message["Message-ID"] = make_msgid(f"payout-destination-{owner_account_id}", domain=mail.sender.split("@")[-1])
    message.set_content(
        f"The {rail} payouts of {name} (account {owner_account_id}) now go to {found.destination}"
        f" (before: {found.previous_destination or 'none'}).\n\n"
        f"Nothing is sent there before {found.usable_from.strftime('%Y-%m-%d %H:%M')} UTC. "
        "If you did not make this change, set the destination back and tell the operator now.\n")
    send_message(mail, message)
    return len(people)
