"""`paralon serve`: the proxy on uvicorn."""
from __future__ import annotations

import logging

import uvicorn

from app.http.inference import create_app
from app.runtime import tune_garbage_collector
from app.settings import Settings
from ledger.db import make_engine


def _loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_server(settings: Settings, host: str, port: int, *, embedded_beat: bool = False) -> None:
    ledger = settings.open_ledger(make_engine(settings.database_url))
    app = create_app(ledger, key_cache_ttl_s=settings.key_cache_ttl_ms / 1000,
                     health_interval_s=settings.health_interval_ms / 1000, hold_ttl_s=settings.hold_ttl_s,
                     hold_sweep_interval_s=settings.hold_sweep_interval_ms / 1000, stripe_settings=settings.stripe(),
                     crypto_settings=settings.crypto(), invoice_settings=settings.invoices(), embedded_beat=embedded_beat)
    tune_garbage_collector()
    for noisy in ("httpx", "stripe"):  # a line per request is noise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        uvicorn.run(app, host=host, port=port, http="httptools", loop=_loop(), log_level="warning", access_log=False)
    finally:
        ledger.close()
