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
    hold_ttl_s: int = 900
    hold_sweep_interval_ms: int = 30_000

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
            hold_ttl_s=_int("PARALON_HOLD_TTL_S", 900, 1, 24 * 3600),
            hold_sweep_interval_ms=_int("PARALON_HOLD_SWEEP_INTERVAL_MS", 30_000, 50, 3_600_000),
        )

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
