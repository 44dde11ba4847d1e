"""Integer money. The ledger unit is one nano-dollar (1e-9 USD)."""
from __future__ import annotations

import re
from decimal import Decimal

from ledger.errors import InvalidAmount
from ledger.limits import AMOUNT_NANO_USD_MAX

# The unit, and what it is worth.
NANO_USD_DECIMALS = 9
NANO_USD_PER_USD = 10**NANO_USD_DECIMALS
CENT_DECIMALS = 2
CENTS_PER_USD = 10**CENT_DECIMALS
NANO_USD_PER_CENT = NANO_USD_PER_USD // CENTS_PER_USD
# The owner of the GPU that served a request gets this share of its charge; the platform the rest.
OWNER_SHARE_PERCENT = 80
PERCENT = 100
# A settlement's postings: the customer's charge, the owner's share, the platform's.
SETTLEMENT_LEGS = 3
# Amounts are written as plain decimals in ASCII digits: Decimal() alone would also
# take "1_000", Arabic-Indic digits and "1e999999999" (which then overflows).
_PLAIN_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
AMOUNT_USD_MAX = AMOUNT_NANO_USD_MAX // NANO_USD_PER_USD
USD_WHOLE_DIGITS_MAX = len(str(AMOUNT_USD_MAX))


def usd_to_nano_usd(text: str | int | Decimal, *, decimals_max: int = NANO_USD_DECIMALS) -> int:
    """Parse a decimal USD amount exactly; refuse more decimals than the unit can hold."""
    raw = str(text).strip()
    if not _PLAIN_DECIMAL.fullmatch(raw):
        raise InvalidAmount(f"not a decimal amount in plain digits (such as 12.50): {text!r}")
    if len(raw.lstrip("+-").split(".")[0].lstrip("0")) > USD_WHOLE_DIGITS_MAX:
        raise InvalidAmount(f"{text!r} exceeds the limit of {AMOUNT_USD_MAX} USD")
    value = Decimal(raw)  # at most 10 whole digits and 9 decimals: exact in Decimal's 28 digits
    if -value.as_tuple().exponent > decimals_max:
        raise InvalidAmount(f"{text!r} has more than {decimals_max} decimals")
    return int(value * NANO_USD_PER_USD)


def nano_usd_per_unit(decimals: int) -> int:
    """Nano-USD in the smallest unit of an amount kept with `decimals` decimals
    (a stablecoin's 6: 1000); exact for up to NANO_USD_DECIMALS."""
    return 10 ** (NANO_USD_DECIMALS - decimals)


def nano_usd_to_usd_text(amount_nano_usd: int) -> str:
    """Exact decimal text, nine decimals: 12500000000 -> '12.500000000'."""
    sign = "-" if amount_nano_usd < 0 else ""
    whole, frac = divmod(abs(amount_nano_usd), NANO_USD_PER_USD)
    return f"{sign}{whole}.{frac:0{NANO_USD_DECIMALS}d}"


def require_positive(amount_nano_usd: int, what: str = "amount") -> int:
    if type(amount_nano_usd) is not int:
        raise InvalidAmount(f"{what} must be an integer number of nano-USD, got {amount_nano_usd!r}")
    if amount_nano_usd <= 0:
        raise InvalidAmount(f"{what} must be positive, got {amount_nano_usd}")
    if amount_nano_usd > AMOUNT_NANO_USD_MAX:
        raise InvalidAmount(f"{what} exceeds the limit of {AMOUNT_NANO_USD_MAX} nano-USD")
    return amount_nano_usd


def split_charge(charge_nano_usd: int) -> tuple[int, int]:
    """(owner share, platform share); they always add up to the charge."""
    owner_nano_usd = charge_nano_usd * OWNER_SHARE_PERCENT // PERCENT
    return owner_nano_usd, charge_nano_usd - owner_nano_usd
