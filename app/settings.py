"""Configuration from the environment: values only, in groups. `app.wiring`
builds what each part takes from them.

Every variable keeps its full name here (`PARALON_…`, as in README's table).
An empty variable counts as unset. Secrets are `SecretStr` and never have
defaults: `repr()`, logs and error messages show them as `**********`; only
`app.wiring` unwraps them, for the part that uses them."""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.limits import (
    PAYOUT_FEE_USD_DEFAULT,
    PAYOUT_MIN_USD_DEFAULT,
    PAYOUT_MIN_USD_MAX,
    PAYOUT_REPLACE_AFTER_S_DEFAULT,
    PAYOUT_REPLACE_AFTER_S_MAX,
    PAYOUT_SEND_INTERVAL_S_DEFAULT,
    PAYOUT_SEND_INTERVAL_S_MAX,
    PAYOUT_SEND_INTERVAL_S_MIN,
    ANCHOR_INTERVAL_S_DEFAULT,
    ANCHOR_INTERVAL_S_MIN,
    CHECKOUT_MAX_USD_DEFAULT,
    CHECKOUT_MIN_USD_DEFAULT,
    CHECKOUT_USD_MAX,
    CRYPTO_CONFIRMATIONS_DEFAULT,
    CRYPTO_CONFIRMATIONS_MAX,
    CRYPTO_SCAN_INTERVAL_S_DEFAULT,
    CRYPTO_START_BLOCK_MAX,
    GROUP_COMMIT_BATCH_COMMANDS_MAX,
    GROUP_COMMIT_WAIT_MS_MAX,
    CAPACITY_PERIOD_MS_MAX,
    HEALTH_INTERVAL_MS_MAX,
    HOLD_SWEEP_INTERVAL_MS_MAX,
    HOLD_SWEEP_INTERVAL_S,
    HOLD_TTL_S_MIN,
    INTERVAL_MS_MIN,
    KEY_CACHE_TTL_MS_MAX,
    LEDGER_VERIFY_INTERVAL_S_DEFAULT,
    LEDGER_VERIFY_INTERVAL_S_MAX,
    LEDGER_VERIFY_INTERVAL_S_MIN,
    SERVE_PORT_DEFAULT,
    TCP_PORT_MAX,
)
from invoices.limits import SMTP_PORT_DEFAULT
from ledger.db import normalise_url
from ledger.money import usd_to_nano_usd
from ledger.limits import (
    BATCH_SIZE_MAX_DEFAULT,
    BATCH_WAIT_MS_DEFAULT,
    HOLD_TTL_S_DEFAULT,
    HOLD_TTL_S_MAX,
    MS_PER_S,
    REPLICA_ID_CHARS_MAX,
)
from proxy.limits import CAPACITY_PERIOD_S, HEALTH_INTERVAL_S, KEY_CACHE_TTL_S
from proxy.routing import AFFINITY, POLICIES

DATABASE_URL_DEFAULT = "sqlite:///./var/paralon.db"
PUBLIC_URL_DEFAULT = f"http://127.0.0.1:{SERVE_PORT_DEFAULT}"
INVOICE_DIR_DEFAULT = "./var/invoices"
MAIL_FROM_DEFAULT = "billing@paralon.example"
ANCHOR_FILE_DEFAULT = "./var/anchors.jsonl"
WITHHELD_JOURNAL_DIR_DEFAULT = "./var/withheld"  # one journal file per replica id (proxy/withheld.py)


def in_ms(seconds: float) -> int:
    """A limit the proxy names in seconds, as a PARALON_*_MS variable takes it."""
    return round(seconds * MS_PER_S)


class SettingsError(ValueError):
    """A variable has a value Paralon cannot use; raised before anything runs."""


def _env(name: str, default: Any = None, **bounds: Any) -> Any:
    """A field read from the variable `name` (the whole name: no prefix is added)."""
    return Field(default, validation_alias=name, **bounds)


class _Group(BaseSettings):
    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore", frozen=True)


class DatabaseConfig(_Group):
    url: str = _env("PARALON_DATABASE_URL", DATABASE_URL_DEFAULT, repr=False)  # may hold a password
    # The owner role's, for `paralon migrate` and repairs (README, "Database roles"); unset: `url`.
    migration_url: str | None = _env("PARALON_MIGRATION_DATABASE_URL", repr=False)
    group_commit_batch_size_max: int = _env("PARALON_GROUP_COMMIT_BATCH_SIZE_MAX", BATCH_SIZE_MAX_DEFAULT,
                                            ge=1, le=GROUP_COMMIT_BATCH_COMMANDS_MAX)
    group_commit_wait_ms: int = _env("PARALON_GROUP_COMMIT_WAIT_MS", int(BATCH_WAIT_MS_DEFAULT),
                                     ge=0, le=GROUP_COMMIT_WAIT_MS_MAX)

    ledger_verify_interval_s: float = _env("PARALON_LEDGER_VERIFY_INTERVAL_S", LEDGER_VERIFY_INTERVAL_S_DEFAULT,
                                           ge=LEDGER_VERIFY_INTERVAL_S_MIN, le=LEDGER_VERIFY_INTERVAL_S_MAX)

    @field_validator("url", "migration_url")
    @classmethod
    def _parses(cls, url: str | None) -> str | None:
        if url is None:
            return None
        normalise_url(url.strip())  # a malformed URL fails here (BadDatabaseUrl), before anything runs
        return url.strip()

    @property
    def owner_url(self) -> str:
        return self.migration_url or self.url


class ProxyConfig(_Group):
    health_interval_ms: int = _env("PARALON_HEALTH_INTERVAL_MS", in_ms(HEALTH_INTERVAL_S),
                                   ge=INTERVAL_MS_MIN, le=HEALTH_INTERVAL_MS_MAX)
    capacity_period_ms: int = _env("PARALON_CAPACITY_PERIOD_MS", in_ms(CAPACITY_PERIOD_S),
                                   ge=INTERVAL_MS_MIN, le=CAPACITY_PERIOD_MS_MAX)
    # `affinity` routes; `random` and `round_robin` are baselines to measure it against (benchmarks/fleet.py).
    routing_policy: str = _env("PARALON_ROUTING_POLICY", AFFINITY)
    key_cache_ttl_ms: int = _env("PARALON_KEY_CACHE_TTL_MS", in_ms(KEY_CACHE_TTL_S), ge=0, le=KEY_CACHE_TTL_MS_MAX)
    hold_ttl_s: int = _env("PARALON_HOLD_TTL_S", HOLD_TTL_S_DEFAULT, ge=HOLD_TTL_S_MIN, le=HOLD_TTL_S_MAX)
    # Requests reserve from one pooled hold per customer and spend limit (ledger.hold_pool), not a hold row each.
    hold_pools: bool = _env("PARALON_HOLD_POOLS", True)
    hold_sweep_interval_ms: int = _env("PARALON_HOLD_SWEEP_INTERVAL_MS", in_ms(HOLD_SWEEP_INTERVAL_S),
                                       ge=INTERVAL_MS_MIN, le=HOLD_SWEEP_INTERVAL_MS_MAX)
    public_url: str = _env("PARALON_PUBLIC_URL", PUBLIC_URL_DEFAULT)
    worker_ca_bundle: str | None = _env("PARALON_WORKER_CA_BUNDLE")
    # Who places this replica's holds; unset: hostname:port (stable across restarts of one instance).
    replica_id: str | None = _env("PARALON_REPLICA_ID", min_length=1, max_length=REPLICA_ID_CHARS_MAX)
    # Where each replica journals the withheld answers whose charge it still owes a reversal.
    withheld_journal_dir: str = _env("PARALON_WITHHELD_JOURNAL_DIR", WITHHELD_JOURNAL_DIR_DEFAULT)
    # Web pages that may call the API from a browser: origins, comma-separated (`*` for any).
    # Unset: no CORS headers at all, so browsers refuse cross-origin calls.
    cors_origins_text: str | None = _env("PARALON_CORS_ORIGINS")

    @field_validator("routing_policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        if policy not in POLICIES:
            raise ValueError(f"must be one of {', '.join(POLICIES)}")
        return policy

    @field_validator("public_url")
    @classmethod
    def _no_trailing_slash(cls, url: str) -> str:
        return url.rstrip("/")

    @field_validator("cors_origins_text")
    @classmethod
    def _origins(cls, text: str | None) -> str | None:
        origins = [origin.strip().rstrip("/") for origin in (text or "").split(",") if origin.strip()]
        for origin in origins:
            parts = urlsplit(origin)
            if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query):
                raise ValueError(f"an origin is scheme://host[:port] or *, not {origin!r}")
        return ",".join(origins) or None

    @property
    def cors_origins(self) -> tuple[str, ...]:
        return tuple(self.cors_origins_text.split(",")) if self.cors_origins_text else ()

    @field_validator("replica_id")
    @classmethod
    def _printable(cls, replica_id: str | None) -> str | None:
        if replica_id is not None and not (replica_id.strip() and replica_id.isprintable()):
            raise ValueError("a replica id is printable text")
        return replica_id and replica_id.strip()


class StripeConfig(_Group):
    secret_key: SecretStr | None = _env("PARALON_STRIPE_SECRET_KEY")
    webhook_secret: SecretStr | None = _env("PARALON_STRIPE_WEBHOOK_SECRET")
    api_base: str | None = _env("PARALON_STRIPE_API_BASE")
    checkout_min_usd: int = _env("PARALON_CHECKOUT_MIN_USD", CHECKOUT_MIN_USD_DEFAULT, ge=1, le=CHECKOUT_USD_MAX)
    checkout_max_usd: int = _env("PARALON_CHECKOUT_MAX_USD", CHECKOUT_MAX_USD_DEFAULT, ge=1, le=CHECKOUT_USD_MAX)


class CryptoConfig(_Group):
    rpc_url: str | None = _env("PARALON_CHAIN_RPC_URL", repr=False)  # may hold an API key
    tokens: str = _env("PARALON_CRYPTO_TOKENS", "")
    confirmations: int = _env("PARALON_CRYPTO_CONFIRMATIONS", CRYPTO_CONFIRMATIONS_DEFAULT, ge=1,
                              le=CRYPTO_CONFIRMATIONS_MAX)
    seed: SecretStr | None = _env("PARALON_CRYPTO_SEED")  # a BIP-39 mnemonic, or the path of a file holding one
    start_block: int = _env("PARALON_CRYPTO_START_BLOCK", 0, ge=0, le=CRYPTO_START_BLOCK_MAX)
    scan_interval_s: float = _env("PARALON_CRYPTO_SCAN_INTERVAL_S", CRYPTO_SCAN_INTERVAL_S_DEFAULT, gt=0)


class PayoutConfig(_Group):
    """Owners' payouts (app/payments/payouts.py); the USDC rail reads the chain through PARALON_CHAIN_RPC_URL."""

    min_usd: int = _env("PARALON_PAYOUT_MIN_USD", PAYOUT_MIN_USD_DEFAULT, ge=1, le=PAYOUT_MIN_USD_MAX)
    fee_usdc_usd: str = _env("PARALON_PAYOUT_FEE_USDC_USD", str(PAYOUT_FEE_USD_DEFAULT))  # a fixed fee, taken at settlement
    fee_stripe_usd: str = _env("PARALON_PAYOUT_FEE_STRIPE_USD", str(PAYOUT_FEE_USD_DEFAULT))
    wallet_key: SecretStr | None = _env("PARALON_PAYOUT_WALLET_KEY")  # the hot wallet: a hex private key, or a file holding one
    token: str | None = _env("PARALON_PAYOUT_TOKEN")  # address:decimals:symbol of the token paid out
    # A transfer not mined this long after it was sent is replaced: same nonce, a higher fee.
    replace_after_s: float = _env("PARALON_PAYOUT_REPLACE_AFTER_S", PAYOUT_REPLACE_AFTER_S_DEFAULT, ge=0,
                                  le=PAYOUT_REPLACE_AFTER_S_MAX)
    send_interval_s: float = _env("PARALON_PAYOUT_SEND_INTERVAL_S", PAYOUT_SEND_INTERVAL_S_DEFAULT,
                                  ge=PAYOUT_SEND_INTERVAL_S_MIN, le=PAYOUT_SEND_INTERVAL_S_MAX)  # beat's USDC sender

    @field_validator("fee_usdc_usd", "fee_stripe_usd")
    @classmethod
    def _whole_nano_usd(cls, text: str) -> str:
        usd_to_nano_usd(text)  # refused here, before anything runs, when it is not a plain amount
        if text.strip().startswith("-"):
            raise ValueError("a fee is not negative")
        return text


class MailConfig(_Group):
    smtp_host: str | None = _env("PARALON_SMTP_HOST")
    smtp_port: int = _env("PARALON_SMTP_PORT", SMTP_PORT_DEFAULT, ge=1, le=TCP_PORT_MAX)
    smtp_user: str | None = _env("PARALON_SMTP_USER")
    smtp_password: SecretStr | None = _env("PARALON_SMTP_PASSWORD")
    sender: str = _env("PARALON_MAIL_FROM", MAIL_FROM_DEFAULT)


class InvoiceConfig(_Group):
    storage_dir: str = _env("PARALON_INVOICE_DIR", INVOICE_DIR_DEFAULT)


class CeleryConfig(_Group):
    broker_url: str | None = _env("PARALON_CELERY_BROKER_URL", repr=False)  # unset: tasks run in-process
    result_url: str | None = _env("PARALON_CELERY_RESULT_URL", repr=False)


class AnchorConfig(_Group):
    """Where the chain's head is written outside the database (app/anchoring/)."""

    file: str = _env("PARALON_ANCHOR_FILE", ANCHOR_FILE_DEFAULT)  # append-only JSON lines; ship it off-host
    interval_s: float = _env("PARALON_ANCHOR_INTERVAL_S", ANCHOR_INTERVAL_S_DEFAULT, ge=ANCHOR_INTERVAL_S_MIN)
    # A hex private key that sends the anchor transactions (to itself) on PARALON_CHAIN_RPC_URL.
    wallet_key: SecretStr | None = _env("PARALON_ANCHOR_WALLET_KEY")


class Settings(BaseModel):
    """Every group; `Settings.from_env()` reads them all at once."""

    model_config = ConfigDict(frozen=True)

    database: DatabaseConfig = Field(default_factory=DatabaseConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    stripe: StripeConfig = Field(default_factory=StripeConfig)
    crypto: CryptoConfig = Field(default_factory=CryptoConfig)
    payouts: PayoutConfig = Field(default_factory=PayoutConfig)
    mail: MailConfig = Field(default_factory=MailConfig)
    invoices: InvoiceConfig = Field(default_factory=InvoiceConfig)
    celery: CeleryConfig = Field(default_factory=CeleryConfig)
    anchors: AnchorConfig = Field(default_factory=AnchorConfig)

    @classmethod
    def from_env(cls) -> Settings:
        """Raises SettingsError naming every variable that is wrong (never a secret's value)."""
        groups, problems = {}, []
        for name, field in cls.model_fields.items():
            try:
                groups[name] = field.default_factory()
            except ValidationError as exc:
                problems.extend(_problems(exc))
        if problems:
            raise SettingsError("; ".join(problems))
        return cls(**groups)


def _problems(exc: ValidationError) -> list[str]:
    problems = []
    for error in exc.errors(include_url=False):
        name = ".".join(str(part) for part in error["loc"])
        shown = "" if _is_secret(name) or "input" not in error else f", got {error['input']!r}"
        problems.append(f"{name}: {error['msg']}{shown}")
    return problems


def _is_secret(variable: str) -> bool:
    return variable in SECRET_VARIABLES


SECRET_VARIABLES = frozenset(
    field.validation_alias
    for group in (DatabaseConfig, ProxyConfig, StripeConfig, CryptoConfig, PayoutConfig, MailConfig, InvoiceConfig, CeleryConfig,
                  AnchorConfig)
    for field in group.model_fields.values()
    if SecretStr in getattr(field.annotation, "__args__", (field.annotation,))
)
