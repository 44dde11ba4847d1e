"""Model prices: quoted per million tokens, kept as whole nano-USD per token."""
from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import Connection, select

from ledger import commands as cmd
from ledger.errors import InvalidAmount
from ledger.money import NANO_USD_PER_USD, usd_to_nano_usd
from ledger.schema import utc_now
from proxy.limits import NAME_CHARS_MAX, PRICE_DECIMALS_MAX, PRICE_USD_PER_MTOK_MAX, TOKENS_PER_MTOK
from proxy.schema import model_prices


class Price(NamedTuple):
    input_nano_usd_per_token: int
    output_nano_usd_per_token: int

    def charge_nano_usd(self, prompt_tokens: int, completion_tokens: int) -> int:
        """Exact: no rounding anywhere."""
        return prompt_tokens * self.input_nano_usd_per_token + completion_tokens * self.output_nano_usd_per_token


def nano_usd_per_token(usd_per_mtok: str) -> int:
    """'0.150000' ($/MTok) -> 150. Refuses a price that is not a whole number of
    nano-USD per token (a multiple of $0.001/MTok): the ledger never rounds."""
    nano_per_mtok = usd_to_nano_usd(usd_per_mtok, decimals_max=PRICE_DECIMALS_MAX)
    if nano_per_mtok < 0:
        raise InvalidAmount(f"a price cannot be negative: {usd_per_mtok!r}")
    if nano_per_mtok > PRICE_USD_PER_MTOK_MAX * NANO_USD_PER_USD:
        raise InvalidAmount(f"a price above ${PRICE_USD_PER_MTOK_MAX}/MTok is refused: {usd_per_mtok!r}")
    per_token, rest = divmod(nano_per_mtok, TOKENS_PER_MTOK)
    if rest:
        raise InvalidAmount(f"${usd_per_mtok}/MTok is not a whole number of nano-USD per token (use a multiple of $0.001/MTok)")
    return per_token


def set_price(conn: Connection, model: str, input_usd_per_mtok: str, output_usd_per_mtok: str) -> Price:
    cmd.require_text(model, "a model name", NAME_CHARS_MAX)
    price = Price(nano_usd_per_token(input_usd_per_mtok), nano_usd_per_token(output_usd_per_mtok))
    if price.output_nano_usd_per_token == 0:
        raise InvalidAmount("the output price must be above zero: it bounds every hold")
    values = dict(input_nano_usd_per_token=price.input_nano_usd_per_token,
                  output_nano_usd_per_token=price.output_nano_usd_per_token, updated_at=utc_now())
    updated = conn.execute(model_prices.update().where(model_prices.c.model == model).values(**values)).rowcount
    if not updated:
        conn.execute(model_prices.insert().values(model=model, **values))
    return price


def load_prices(conn: Connection) -> dict[str, Price]:
    return {r.model: Price(r.input_nano_usd_per_token, r.output_nano_usd_per_token) for r in conn.execute(select(model_prices))}
