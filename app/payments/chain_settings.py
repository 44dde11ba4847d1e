"""What the chain rails are configured with: stablecoin top-ups (deposit
addresses, tokens, confirmations) and the USDC payout wallet.

Plain values, so that building them never loads web3 (about a second of
imports): `paralon serve` and every command build them at start, and only a
deployment that configures a chain needs the library that talks to one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from app.limits import PAYOUT_REPLACE_AFTER_S_DEFAULT
from ledger.errors import InvalidInput
from ledger.money import NANO_USD_DECIMALS


@dataclass(frozen=True)
class Token:
    address: str  # checksummed
    decimals: int
    symbol: str


@dataclass(frozen=True)
class CryptoSettings:
    rpc_url: str | None
    tokens: tuple[Token, ...]
    confirmations: int
    seed: str | None = field(repr=False)  # secrets stay out of reprs and logs
    start_block: int = 0


@dataclass(frozen=True)
class PayoutChainSettings:
    rpc_url: str | None = field(repr=False)  # may hold an API key
    wallet_key: str | None = field(repr=False)  # the hot wallet's private key: never shown
    token: Token | None
    confirmations: int
    replace_after_s: float = PAYOUT_REPLACE_AFTER_S_DEFAULT

    def missing(self) -> list[str]:
        wanted = (("PARALON_PAYOUT_WALLET_KEY", self.wallet_key), ("PARALON_PAYOUT_TOKEN", self.token),
                  ("PARALON_CHAIN_RPC_URL", self.rpc_url))
        return [name for name, value in wanted if not value]


def parse_tokens(text: str) -> tuple[Token, ...]:
    """'0xabc…:6:USDC,0xdef…:6:USDT' -> tokens; a stablecoin of at most 9 decimals
    converts to nano-USD exactly."""
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        return ()
    from eth_utils import to_checksum_address  # only when a token is configured

    tokens = []
    for item in items:
        try:
            address, decimals, symbol = item.split(":")
            token = Token(to_checksum_address(address), int(decimals), symbol)
        except ValueError:
            raise InvalidInput(f"PARALON_CRYPTO_TOKENS wants address:decimals:symbol, got {item!r}") from None
        if not 0 <= token.decimals <= NANO_USD_DECIMALS:
            raise InvalidInput(f"{token.symbol}: at most {NANO_USD_DECIMALS} decimals convert to nano-USD exactly")
        tokens.append(token)
    return tuple(tokens)


def read_seed(value: str | None) -> str | None:
    """A secret (a BIP-39 mnemonic, the payout wallet's private key), or the path of a file holding one."""
    if value and Path(value).is_file():
        return Path(value).read_text().strip()
    return value.strip() if value else None
