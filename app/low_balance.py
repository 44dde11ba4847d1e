"""A customer's low-balance alert: the threshold it sets, and what the alert
run (app/jobs/low_balance_alerts.py) marked.

The threshold is whole cents of USD given as decimal text ("2.00"), kept in
nano-USD on the account; None turns the alert off. Setting it arms the
alert afresh: a balance already below the new threshold is alerted at the
next run."""
from __future__ import annotations

import re

from sqlalchemy import Connection, select, update

from ledger import commands as cmd
from ledger.accounts import read_balance, require_kind
from ledger.errors import InvalidAmount
from ledger.money import CENT_DECIMALS, CENTS_PER_USD, NANO_USD_PER_CENT, usd_to_nano_usd
from ledger.schema import accounts

# Exactly what the API document allows: digits, and at most two decimals after a point.
_THRESHOLD_TEXT = re.compile(r"[0-9]+(\.[0-9]{1,2})?")


def parse_threshold_usd(value: object) -> int | None:
    """Nano-USD of a threshold given as decimal text with at most two
    decimals, above zero; None (JSON null) for no alert."""
    if value is None:
        return None
    if not isinstance(value, str) or not _THRESHOLD_TEXT.fullmatch(value):
        raise InvalidAmount('threshold_usd is USD as decimal text with two decimals at most, such as "2.00" '
                            "(or null to turn the alert off)")
    threshold = usd_to_nano_usd(value, decimals_max=CENT_DECIMALS)
    if threshold <= 0:
        raise InvalidAmount(f"threshold_usd must be above zero, got {value!r} (null turns the alert off)")
    return threshold


def set_alert(conn: Connection, account_id: int, threshold_usd: object) -> dict:
    """Set (or, with None, remove) a customer account's threshold; nothing is written when it is refused."""
    threshold = parse_threshold_usd(threshold_usd)
    require_kind(conn, account_id, (cmd.CUSTOMER,), "a low-balance alert is for a customer account")
    conn.execute(update(accounts).where(accounts.c.id == account_id)
                 .values(low_balance_threshold_nano_usd=threshold, low_balance_alerted_at=None))
    return alert_view(conn, account_id)


def alert_view(conn: Connection, account_id: int) -> dict:
    """The threshold (None: off), whether the balance is below it now, and when the current crossing was alerted."""
    require_kind(conn, account_id, (cmd.CUSTOMER,), "a low-balance alert is for a customer account")
    row = conn.execute(select(accounts.c.low_balance_threshold_nano_usd, accounts.c.low_balance_alerted_at)
                       .where(accounts.c.id == account_id)).one()
    threshold = row.low_balance_threshold_nano_usd
    available = read_balance(conn, account_id).available_nano_usd
    return {"account_id": account_id, "threshold_nano_usd": threshold,
            "threshold_usd": usd_cents_text(threshold) if threshold is not None else None,
            "available_nano_usd": available, "below": threshold is not None and available < threshold,
            "alerted_at": row.low_balance_alerted_at.isoformat() if row.low_balance_alerted_at else None}


def usd_cents_text(amount_nano_usd: int) -> str:
    """A whole number of cents as the text it is set with: 2000000000 -> '2.00'."""
    cents = amount_nano_usd // NANO_USD_PER_CENT
    return f"{cents // CENTS_PER_USD}.{cents % CENTS_PER_USD:0{CENT_DECIMALS}d}"
