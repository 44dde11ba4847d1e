"""The settings default to the values the parts own, in the units the variables take."""
from __future__ import annotations

import inspect
import os

from app.http.factory import create_app
from app.limits import HOLD_SWEEP_INTERVAL_S
from app.settings import Settings
from invoices.limits import SMTP_PORT_DEFAULT
from ledger.limits import BATCH_SIZE_MAX_DEFAULT, HOLD_TTL_S_DEFAULT, MS_PER_S
from proxy.limits import HEALTH_INTERVAL_S, KEY_CACHE_TTL_S

CREDITS_HELD_AFTER_CRASH_S_MAX = 60  # issue 12: credits free within a minute of a crash
SWEEP_MARGIN_S = 20  # for the sweep itself, a loaded database, a renewal that came late


def test_the_settings_default_to_what_each_part_owns(monkeypatch):
    for name in [name for name in os.environ if name.startswith("PARALON_")]:
        monkeypatch.delenv(name)
    settings = Settings()
    assert settings.proxy.health_interval_ms == HEALTH_INTERVAL_S * MS_PER_S
    assert settings.proxy.key_cache_ttl_ms == KEY_CACHE_TTL_S * MS_PER_S
    assert settings.proxy.hold_sweep_interval_ms == HOLD_SWEEP_INTERVAL_S * MS_PER_S
    assert settings.proxy.hold_ttl_s == HOLD_TTL_S_DEFAULT
    assert settings.database.group_commit_batch_size_max == BATCH_SIZE_MAX_DEFAULT
    assert settings.mail.smtp_port == SMTP_PORT_DEFAULT


def test_the_service_defaults_to_what_each_part_owns():
    served = inspect.signature(create_app).parameters
    assert served["key_cache_ttl_s"].default == KEY_CACHE_TTL_S and served["health_interval_s"].default == HEALTH_INTERVAL_S
    assert served["hold_ttl_s"].default == HOLD_TTL_S_DEFAULT and served["hold_sweep_interval_s"].default == HOLD_SWEEP_INTERVAL_S


def test_with_the_defaults_a_crash_frees_credits_within_a_minute():
    """A replica that never comes back: its holds expire a lifetime after their
    last renewal, and the next sweep of another replica closes them."""
    assert HOLD_TTL_S_DEFAULT + HOLD_SWEEP_INTERVAL_S <= CREDITS_HELD_AFTER_CRASH_S_MAX - SWEEP_MARGIN_S

