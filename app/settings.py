"""Configuration from the environment. Secrets never have defaults."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ledger.db import normalise_url
from ledger.group_commit import BATCH_SIZE_MAX_DEFAULT, BATCH_WAIT_MS_DEFAULT

DATABASE_URL_DEFAULT = "sqlite:///./var/paralon.db"


@dataclass(frozen=True)
class Settings:
    database_url: str
    group_commit_batch_size_max: int = BATCH_SIZE_MAX_DEFAULT
    group_commit_wait_ms: int = int(BATCH_WAIT_MS_DEFAULT)
    health_interval_ms: int = 2000
    key_cache_ttl_ms: int = 1000
    hold_ttl_s: int = 60
    hold_sweep_interval_ms: int = 30_000
    stripe_secret_key: str | None = None
    stripe_webhook_secret: str | None = None
    stripe_api_base: str | None = None
    checkout_min_usd: int = 5
    checkout_max_usd: int = 10_000
    public_url: str = "http://127.0.0.1:8000"
    chain_rpc_url: str | None = None
    crypto_tokens: str = ""
    crypto_confirmations: int = 12
    crypto_seed: str | None = None
    crypto_start_block: int = 0
    invoice_dir: str = "./var/invoices"
    smtp_host: str | None = None
    smtp_port: int = 25
    smtp_user: str | None = None
    smtp_password: str | None = None
    mail_from: str = "billing@paralon.example"

    @classmethod
    def from_env(cls) -> "Settings":
        url = os.environ.get("PARALON_DATABASE_URL", "").strip() or DATABASE_URL_DEFAULT
        normalise_url(url)  # a malformed URL fails here, before anything runs
        return cls(
            database_url=url,
            group_commit_batch_size_max=_int("PARALON_GROUP_COMMIT_BATCH_SIZE_MAX", BATCH_SIZE_MAX_DEFAULT, 1, 10_000),
            group_commit_wait_ms=_int("PARALON_GROUP_COMMIT_WAIT_MS", int(BATCH_WAIT_MS_DEFAULT), 0, 100),
            health_interval_ms=_int("PARALON_HEALTH_INTERVAL_MS", 2000, 50, 60_000),
            key_cache_ttl_ms=_int("PARALON_KEY_CACHE_TTL_MS", 1000, 0, 60_000),
            hold_ttl_s=_int("PARALON_HOLD_TTL_S", 60, 2, 24 * 3600),
            hold_sweep_interval_ms=_int("PARALON_HOLD_SWEEP_INTERVAL_MS", 10_000, 50, 3_600_000),
            stripe_secret_key=os.environ.get("PARALON_STRIPE_SECRET_KEY") or None,
            stripe_webhook_secret=os.environ.get("PARALON_STRIPE_WEBHOOK_SECRET") or None,
            stripe_api_base=os.environ.get("PARALON_STRIPE_API_BASE") or None,
            checkout_min_usd=_int("PARALON_CHECKOUT_MIN_USD", 5, 1, 1_000_000),
            checkout_max_usd=_int("PARALON_CHECKOUT_MAX_USD", 10_000, 1, 1_000_000),
            public_url=(os.environ.get("PARALON_PUBLIC_URL") or "http://127.0.0.1:8000").rstrip("/"),
            chain_rpc_url=os.environ.get("PARALON_CHAIN_RPC_URL") or None,
            crypto_tokens=os.environ.get("PARALON_CRYPTO_TOKENS", ""),
            crypto_confirmations=_int("PARALON_CRYPTO_CONFIRMATIONS", 12, 1, 10_000),
            crypto_seed=os.environ.get("PARALON_CRYPTO_SEED") or None,
            crypto_start_block=_int("PARALON_CRYPTO_START_BLOCK", 0, 0, 10**12),
            invoice_dir=os.environ.get("PARALON_INVOICE_DIR") or "./var/invoices",
            smtp_host=os.environ.get("PARALON_SMTP_HOST") or None,
            smtp_port=_int("PARALON_SMTP_PORT", 25, 1, 65535),
            smtp_user=os.environ.get("PARALON_SMTP_USER") or None,
            smtp_password=os.environ.get("PARALON_SMTP_PASSWORD") or None,
            mail_from=os.environ.get("PARALON_MAIL_FROM") or "billing@paralon.example",
        )

    def stripe(self):
        from app.payments.stripe import StripeSettings

        return StripeSettings(self.stripe_secret_key, self.stripe_webhook_secret, self.stripe_api_base,
                              self.checkout_min_usd * 100, self.checkout_max_usd * 100,
                              f"{self.public_url}/checkout/done?session_id={{CHECKOUT_SESSION_ID}}", f"{self.public_url}/checkout/cancelled")

    def crypto(self):
        from app.payments.crypto import CryptoSettings, parse_tokens, read_seed

        return CryptoSettings(self.chain_rpc_url, parse_tokens(self.crypto_tokens), self.crypto_confirmations,
                              read_seed(self.crypto_seed), self.crypto_start_block)

    def invoices(self):
        from pathlib import Path

        from invoices.service import InvoiceSettings

        return InvoiceSettings(Path(self.invoice_dir))

    def mail(self):
        from invoices.mail import MailSettings

        return MailSettings(self.smtp_host, self.smtp_port, self.smtp_user, self.smtp_password, self.mail_from)

    def open_ledger(self, engine):
        """The ledger with this process's group-commit limits."""
        from ledger.service import Ledger

        return Ledger(engine, batch_size_max=self.group_commit_batch_size_max, batch_wait_ms=self.group_commit_wait_ms)


def _int(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
    return value
