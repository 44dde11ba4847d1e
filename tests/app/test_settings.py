"""Settings: the same PARALON_ variables as README's table, in groups; wrong
values named before anything runs; and the Stripe keys, the wallet seed and
the SMTP password never printed: not by repr or str of the settings or of any
settings object built from them, not in a log line, not in an error."""
from __future__ import annotations

import json
import logging
import os
import re
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from app import wiring
from app.cli import main
from app.http.server import replica_id
from app.settings import DATABASE_URL_DEFAULT, SECRET_VARIABLES, Settings, SettingsError

README = Path(__file__).resolve().parents[2] / "README.md"
SEED = "test test test test test test test test test test test junk"
SECRETS = {
    "PARALON_STRIPE_SECRET_KEY": "sk_test_4eC39HqLyjWDarjtT1zdp7dc",
    "PARALON_STRIPE_WEBHOOK_SECRET": "whsec_5ecretF0rT3sts0nly",
    "PARALON_CRYPTO_SEED": SEED,
    "PARALON_SMTP_PASSWORD": "correct-horse-battery-staple",
    "PARALON_ANCHOR_WALLET_KEY": "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d",
    "PARALON_PAYOUT_WALLET_KEY": "0x5de4111afa1a4b94908f83103eb1f1706367c2e68ca870fc3fb9a804cdab365a",
}
NOT_SETTINGS = {"PARALON_SIM_TIME_SCALE"}  # read by the simulated worker, a separate program


@pytest.fixture
def env(monkeypatch):
    for name in [name for name in os.environ if name.startswith("PARALON_")]:
        monkeypatch.delenv(name)
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PARALON_SMTP_HOST", "mail.example")
    return monkeypatch


def _shows_a_secret(text: str) -> list[str]:
    return [name for name, value in SECRETS.items() if value in text]


def test_no_repr_or_str_shows_a_secret(env):
    settings = Settings.from_env()
    built = [settings, settings.stripe, settings.crypto, settings.mail, wiring.stripe_settings(settings),
             wiring.crypto_settings(settings), wiring.mail_settings(settings), wiring.invoice_settings(settings)]
    for thing in built:
        for text in (repr(thing), str(thing)):
            assert _shows_a_secret(text) == [], f"{type(thing).__name__} shows a secret"
    assert _shows_a_secret(settings.model_dump_json()) == []


def test_the_parts_still_get_their_secrets(env):
    settings = Settings.from_env()
    stripe, crypto, mail = wiring.stripe_settings(settings), wiring.crypto_settings(settings), wiring.mail_settings(settings)
    assert (stripe.secret_key, stripe.webhook_secret) == (SECRETS["PARALON_STRIPE_SECRET_KEY"], SECRETS["PARALON_STRIPE_WEBHOOK_SECRET"])
    assert (crypto.seed, mail.password) == (SEED, SECRETS["PARALON_SMTP_PASSWORD"])


def test_a_log_line_shows_no_secret(env, caplog):
    settings = Settings.from_env()
    log = logging.getLogger("paralon.test")
    with caplog.at_level(logging.INFO):
        log.info("starting with %s and %r", settings, settings)
        log.info("stripe %s, crypto %s, mail %s", wiring.stripe_settings(settings), wiring.crypto_settings(settings),
                 wiring.mail_settings(settings))
    assert caplog.text and _shows_a_secret(caplog.text) == []


def test_a_wrong_value_is_named_before_anything_runs_and_shows_no_secret(env, tmp_path):
    env.setenv("PARALON_SMTP_PORT", "twenty-five")
    env.setenv("PARALON_HOLD_TTL_S", "1")
    env.setenv("PARALON_DATABASE_URL", f"sqlite:///{tmp_path}/never.db")
    with pytest.raises(SettingsError) as wrong:
        Settings.from_env()
    message = str(wrong.value)
    assert "PARALON_SMTP_PORT" in message and "'twenty-five'" in message and "PARALON_HOLD_TTL_S" in message
    assert _shows_a_secret(message) == []

    result = CliRunner().invoke(main, ["balance", "1", "--json"])
    assert result.exit_code == 2 and not (tmp_path / "never.db").exists(), "refused before the database is touched"
    error = json.loads(result.stderr)["error"]
    assert "PARALON_SMTP_PORT" in error["message"] and _shows_a_secret(result.output + result.stderr) == []


def test_a_wrong_seed_is_refused_without_its_words(env):
    env.setenv("PARALON_CRYPTO_SEED", "correct horse battery staple")
    with pytest.raises(SettingsError) as wrong:
        wiring.crypto_settings(Settings.from_env())
    assert "PARALON_CRYPTO_SEED" in str(wrong.value) and "horse" not in str(wrong.value)
    assert wrong.value.__cause__ is None and wrong.value.__suppress_context__, "the library's message is not chained"


def test_the_variables_are_readmes(env):
    documented = set(re.findall(r"`(PARALON_[A-Z0-9_]+)`", README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]))
    read = {field.validation_alias for group in Settings.model_fields.values()
            for field in group.default_factory.model_fields.values()}
    assert read == documented - NOT_SETTINGS
    assert SECRET_VARIABLES == set(SECRETS), "secrets are exactly these"


def test_groups_read_their_variables(env):
    env.setenv("PARALON_PUBLIC_URL", "https://paralon.example/")
    env.setenv("PARALON_CHECKOUT_MAX_USD", "500")
    env.setenv("PARALON_GROUP_COMMIT_WAIT_MS", "")  # empty counts as unset
    settings = Settings.from_env()
    assert settings.proxy.public_url == "https://paralon.example" and settings.stripe.checkout_max_usd == 500
    assert settings.database.group_commit_wait_ms == 1 and settings.mail.smtp_host == "mail.example"
    assert wiring.stripe_settings(settings).cancel_url == "https://paralon.example/checkout/cancelled"
    assert wiring.stripe_settings(settings).checkout_max_cents == 500 * 100


def test_only_paralon_variables_are_read_never_a_bare_field_name(env):
    """Given ordinary variables that share a field's name (Django's SECRET_KEY,
    a URL), the settings ignore them: only PARALON_* names configure Paralon."""
    for name, value in {"URL": "sqlite:////tmp/elsewhere.db", "SECRET_KEY": "sk_live_not_ours", "API_BASE": "https://elsewhere.example",
                        "HOLD_TTL_S": "5", "SMTP_HOST": "mail.elsewhere", "BROKER_URL": "redis://elsewhere:6379/0"}.items():
        env.setenv(name, value)
    settings = Settings.from_env()
    assert settings.database.url == DATABASE_URL_DEFAULT
    assert settings.stripe.secret_key.get_secret_value() == SECRETS["PARALON_STRIPE_SECRET_KEY"]
    assert settings.stripe.api_base is None and settings.celery.broker_url is None
    assert settings.proxy.hold_ttl_s != 5 and settings.mail.smtp_host == "mail.example"


def test_urls_that_may_hold_a_password_are_not_printed(env):
    env.setenv("PARALON_DATABASE_URL", "postgresql://paralon:db-pass-1234@db.example:5432/paralon")
    env.setenv("PARALON_CELERY_BROKER_URL", "redis://:broker-pass-1234@redis.example:6379/0")
    env.setenv("PARALON_CHAIN_RPC_URL", "https://rpc.example/v2/rpc-key-1234")
    text = repr(Settings.from_env())
    assert not any(secret in text for secret in ("db-pass-1234", "broker-pass-1234", "rpc-key-1234")), text


def test_a_replica_is_named_by_its_host_and_port_unless_given_a_name(env):
    assert replica_id(Settings.from_env(), 8000) == f"{socket.gethostname()}:8000"
    env.setenv("PARALON_REPLICA_ID", " proxy-a ")
    assert replica_id(Settings.from_env(), 8000) == "proxy-a"
    for wrong in ("   ", "proxy\tb", "x" * 201):
        env.setenv("PARALON_REPLICA_ID", wrong)
        with pytest.raises(SettingsError, match="PARALON_REPLICA_ID"):
            Settings.from_env()
