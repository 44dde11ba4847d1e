"""Revocations reach every `serve` process at once (PostgreSQL LISTEN/NOTIFY).

`revoke_secret` notifies REVOCATION_CHANNEL in the revoking transaction; each
process keeps one connection listening and evicts the key from its cache as
soon as the notification arrives. Notifications sent while a process was not
listening are lost, so each (re)connection forgets every cached key once it
listens again. The cache's time to live stays the fallback meanwhile."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import psycopg
from sqlalchemy import Engine

from proxy.keys import REVOCATION_CHANNEL, parse_revocation
from proxy.limits import (
    REVOCATION_CONNECT_TIMEOUT_S,
    REVOCATION_LIVENESS_CHECK_INTERVAL_S,
    REVOCATION_RECONNECT_BACKOFF_FACTOR,
    REVOCATION_RECONNECT_WAIT_S_MAX,
    REVOCATION_RECONNECT_WAIT_S_MIN,
)

log = logging.getLogger(__name__)

LISTENER_APPLICATION_NAME = "paralon-revocations"


def listener_conninfo(engine: Engine) -> str:
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


async def follow_revocations(engine: Engine, on_revoked: Callable[[str, int], None],
                             on_listening: Callable[[], None]) -> None:
    """Until cancelled: `on_revoked(table, id)` for every revocation, and
    `on_listening()` each time listening (re)starts."""
    wait_s = REVOCATION_RECONNECT_WAIT_S_MIN

    def listening() -> None:
        nonlocal wait_s
        wait_s = REVOCATION_RECONNECT_WAIT_S_MIN
        on_listening()

    while True:
        try:
            await _listen(listener_conninfo(engine), on_revoked, listening)
        except (psycopg.Error, OSError) as exc:
            log.warning("revocation listener lost its connection (%s); reconnecting in %.1f s", exc, wait_s)
        await asyncio.sleep(wait_s)
        wait_s = min(wait_s * REVOCATION_RECONNECT_BACKOFF_FACTOR, REVOCATION_RECONNECT_WAIT_S_MAX)


async def _listen(conninfo: str, on_revoked: Callable[[str, int], None], on_listening: Callable[[], None]) -> None:
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True, connect_timeout=REVOCATION_CONNECT_TIMEOUT_S,
                                                     application_name=LISTENER_APPLICATION_NAME) as conn:
        listen = f"LISTEN {REVOCATION_CHANNEL}"
        await conn.execute(listen)
        on_listening()
        while True:
            async for notify in conn.notifies(timeout=REVOCATION_LIVENESS_CHECK_INTERVAL_S):
                revoked = parse_revocation(notify.payload)
                if revoked is not None:
                    on_revoked(*revoked)
            await conn.execute(listen)  # silent for a while: is the connection still there? (listening again changes nothing)
