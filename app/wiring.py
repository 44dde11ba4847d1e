"""Builds what each part takes from the settings: the Ledger with this
process's group-commit limits, and the settings objects of payments, invoices
and mail. Secrets are unwrapped here and nowhere else; the objects built keep
them out of their reprs.

Each factory imports the part it builds for when it is called: the command
line imports this module for every command, and web3, Stripe and WeasyPrint
would add about 1.4 s to each (`python -X importtime`)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine

from app.payments.chain_settings import CryptoSettings, PayoutChainSettings, parse_tokens, read_seed
from app.settings import Settings, SettingsError
from ledger.db import make_engine
from ledger.money import CENTS_PER_USD, usd_to_nano_usd
from ledger.service import Ledger

if TYPE_CHECKING:
    from app.anchoring.service import AnchorSettings
    from app.console.signin import ConsoleSettings
    from app.payments.payouts import PayoutRules
    from app.payments.stripe import StripeSettings
    from invoices.mail import MailSettings
    from invoices.service import InvoiceSettings


def open_ledger(settings: Settings, engine: Engine | None = None) -> Ledger:
    """The ledger with this process's group-commit limits (on a new engine unless one is given)."""
    database = settings.database
    return Ledger(engine or make_engine(database.url), batch_size_max=database.group_commit_batch_size_max,
                  batch_wait_ms=database.group_commit_wait_ms)


def redis_url(settings: Settings) -> str | None:
    """The Redis this process depends on (the Celery broker), if one is configured."""
    broker = settings.celery.broker_url
    return broker if broker and broker.startswith(("redis://", "rediss://")) else None


def stripe_settings(settings: Settings) -> StripeSettings:
    from app.payments.stripe import StripeSettings  # see the module's docstring

    stripe, public_url = settings.stripe, settings.proxy.public_url
    return StripeSettings(
        secret_key=_reveal(stripe.secret_key), webhook_secret=_reveal(stripe.webhook_secret), api_base=stripe.api_base,
        checkout_min_cents=stripe.checkout_min_usd * CENTS_PER_USD, checkout_max_cents=stripe.checkout_max_usd * CENTS_PER_USD,
        success_url=f"{public_url}/checkout/done?session_id={{CHECKOUT_SESSION_ID}}",
        cancel_url=f"{public_url}/checkout/cancelled",
    )


def crypto_settings(settings: Settings) -> CryptoSettings:
    crypto = settings.crypto
    if crypto.rpc_url:  # a configured chain loads web3 now, not on the thread of the first request that asks the node
        import app.payments.crypto  # noqa: F401
    return CryptoSettings(rpc_url=crypto.rpc_url, tokens=parse_tokens(crypto.tokens), confirmations=crypto.confirmations,
                          seed=_usable_seed(read_seed(_reveal(crypto.seed))), start_block=crypto.start_block)


def payout_rules(settings: Settings) -> PayoutRules:
    from app.payments.payouts import STRIPE, USDC, PayoutRules, payout_token_decimals

    payouts = settings.payouts
    return PayoutRules(min_nano_usd=usd_to_nano_usd(payouts.min_usd),
                       fee_nano_usd={USDC: usd_to_nano_usd(payouts.fee_usdc_usd), STRIPE: usd_to_nano_usd(payouts.fee_stripe_usd)},
                       usdc_decimals=payout_token_decimals(payouts.token))


def payout_chain_settings(settings: Settings) -> PayoutChainSettings:
    """The USDC rail's hot wallet, token and chain; what is unset stays None
    (the sender names it and does nothing)."""
    payouts = settings.payouts
    key = read_seed(_reveal(payouts.wallet_key))
    if key is not None:
        from app.payments.payout_chain import wallet_address  # see the module's docstring

        try:
            wallet_address(key)
        except (ValueError, TypeError):
            raise SettingsError("PARALON_PAYOUT_WALLET_KEY is not a hex private key nor a file holding one "
                                "(its value is not shown)") from None
    tokens = parse_tokens(payouts.token) if payouts.token else ()
    if len(tokens) > 1:
        raise SettingsError("PARALON_PAYOUT_TOKEN names one token: address:decimals:symbol")
    return PayoutChainSettings(rpc_url=settings.crypto.rpc_url, wallet_key=key, token=tokens[0] if tokens else None,
                               confirmations=settings.crypto.confirmations, replace_after_s=payouts.replace_after_s)


def _usable_seed(seed: str | None) -> str | None:
    """A seed that derives addresses. A wrong one is refused here, in words of our
    own: the wallet library's error quotes the mnemonic."""
    if seed is None:
        return None
    from app.payments.deposits import derive_address  # see the module's docstring
    from eth_utils.exceptions import ValidationError

    try:
        derive_address(seed, 0)
    except ValidationError:
        raise SettingsError("PARALON_CRYPTO_SEED is not a valid BIP-39 mnemonic (its words are not shown)") from None
    return seed


def invoice_settings(settings: Settings) -> InvoiceSettings:
    from invoices.service import InvoiceSettings  # see the module's docstring

    return InvoiceSettings(Path(settings.invoices.storage_dir))


def console_settings(settings: Settings) -> ConsoleSettings:
    from app.console.signin import ConsoleSettings  # see the module's docstring

    return ConsoleSettings(public_url=settings.proxy.public_url, mail=mail_settings(settings))


def mail_settings(settings: Settings) -> MailSettings:
    from invoices.mail import MailSettings  # see the module's docstring

    mail = settings.mail
    return MailSettings(host=mail.smtp_host, port=mail.smtp_port, user=mail.smtp_user,
                        password=_reveal(mail.smtp_password), sender=mail.sender)


def anchor_settings(settings: Settings) -> AnchorSettings:
    """The anchor file, and the chain when a wallet key is set (on the deposits' node)."""
    from app.anchoring.service import AnchorSettings  # see the module's docstring

    key = _reveal(settings.anchors.wallet_key)
    if key is None:
        return AnchorSettings(Path(settings.anchors.file))
    from app.anchoring.chain import ChainAnchorSettings

    if not settings.crypto.rpc_url:
        raise SettingsError("PARALON_ANCHOR_WALLET_KEY needs PARALON_CHAIN_RPC_URL, the node anchors are sent to")
    chain = ChainAnchorSettings(settings.crypto.rpc_url, key)
    try:
        chain.address  # noqa: B018 (a key that is no private key fails here, in words of our own)
    except (ValueError, TypeError):
        raise SettingsError("PARALON_ANCHOR_WALLET_KEY is not a hex private key (its value is not shown)") from None
    return AnchorSettings(Path(settings.anchors.file), chain)


def _reveal(secret) -> str | None:
    return secret.get_secret_value() if secret is not None else None
