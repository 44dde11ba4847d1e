"""Integer money. The ledger unit is one nano-dollar (1e-9 USD)."""
from __future__ import annotations

from decimal import Decimal, InvalidOperation

from ledger.errors import InvalidAmount

NANO_USD_PER_USD = 1_000_000_000
NANO_USD_PER_CENT = 10_000_000
OWNER_SHARE_PERCENT = 80
# BIGINT holds 9.2e18 nano-USD (9.2 billion USD); one amount is kept far below.
AMOUNT_NANO_USD_MAX = 10**18


def usd_to_nano_usd(text: str | int | Decimal, *, decimals_max: int = 9) -> int:
    """Parse a decimal USD amount exactly; refuse more decimals than the unit can hold."""
    try:
        value = Decimal(str(text).strip())
    except InvalidOperation:
        raise InvalidAmount(f"not a decimal amount: {text!r}") from None
    if not value.is_finite():
        raise InvalidAmount(f"not a finite amount: {text!r}")
    exponent = value.as_tuple().exponent
    if isinstance(exponent, int) and -exponent > decimals_max:
        raise InvalidAmount(f"{text!r} has more than {decimals_max} decimals")
    nano = value * NANO_USD_PER_USD
    if nano != nano.to_integral_value():
        raise InvalidAmount(f"{text!r} is not a whole number of nano-dollars")
    return int(nano)


def nano_usd_to_usd_text(amount_nano_usd: int) -> str:
    """Exact decimal text, nine decimals: 12500000000 -> '12.500000000'."""
    sign = "-" if amount_nano_usd < 0 else ""
    whole, frac = divmod(abs(amount_nano_usd), NANO_USD_PER_USD)
    return f"{sign}{whole}.{frac:09d}"


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
    owner_nano_usd = charge_nano_usd * OWNER_SHARE_PERCENT // 100
    return owner_nano_usd, charge_nano_usd - owner_nano_usd
