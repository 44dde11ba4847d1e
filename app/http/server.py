"""`paralon serve`: the HTTP service on uvicorn, with uvloop when it is installed,
and the read models' follower beside it (app/jobs/read_model_follower.py)."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

import uvicorn
from litestar import Litestar

from app import wiring
from app.http.factory import create_app
from app.http.chunk_writers import ChunkWriterProtocol
from app.jobs.read_model_follower import FollowerState, ReadModelFollower
from app.limits import HTTP_IDLE_CONNECTION_KEPT_S
from app.runtime import event_loop_name, tune_garbage_collector
from app.settings import Settings
from ledger.limits import MS_PER_S

QUIET_LOGGERS = ("httpx", "stripe")  # a line per request is noise


def replica_id(settings: Settings, port: int) -> str:
    """PARALON_REPLICA_ID, else hostname:port: the same for every restart of one
    instance, distinct between replicas on one host or on several."""
    return settings.proxy.replica_id or f"{socket.gethostname()}:{port}"


def journal_path(directory: str, replica: str) -> str:
    """The withheld journal of this replica: its id, made a safe file name."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in replica)
    return os.path.join(directory, f"{safe}.jsonl")


class _Server(uvicorn.Server):
    """uvicorn's server, telling `on_listening` once its sockets accept connections."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[], None] | None) -> None:
        super().__init__(config)
        self.on_listening = on_listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_listening is not None:
            self.on_listening()


def run_server(settings: Settings, host: str, port: int, *, embedded_beat: bool = False,
               on_listening: Callable[[], None] | None = None) -> None:
    """Until stopped (SIGINT, SIGTERM): uvicorn drains the app, then the follower stops between two pages."""
    ledger = wiring.open_ledger(settings)
    proxy = settings.proxy
    app = create_app(ledger, key_cache_ttl_s=proxy.key_cache_ttl_ms / MS_PER_S,
                     health_interval_s=proxy.health_interval_ms / MS_PER_S, hold_ttl_s=proxy.hold_ttl_s,
                     capacity_period_s=proxy.capacity_period_ms / MS_PER_S, routing_policy=proxy.routing_policy,
                     hold_sweep_interval_s=proxy.hold_sweep_interval_ms / MS_PER_S, worker_ca_bundle_path=proxy.worker_ca_bundle,
                     hold_pools=proxy.hold_pools,
                     stripe_settings=wiring.stripe_settings(settings), crypto_settings=wiring.crypto_settings(settings),
                     invoice_settings=wiring.invoice_settings(settings), embedded_beat=embedded_beat,
                     replica_id=replica_id(settings, port),
                     withheld_journal_path=journal_path(proxy.withheld_journal_dir, replica_id(settings, port)))
    follower = ReadModelFollower(ledger.engine)
    app.state.metrics.register(FollowerState(follower))
    app.state.read_model_follower = follower
    app.on_shutdown.append(_stop_follower)  # after the drain; uvicorn then re-raises SIGTERM, past any finally here
    tune_garbage_collector()
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    config = uvicorn.Config(app, host=host, port=port, http=ChunkWriterProtocol, loop=event_loop_name(), log_level="warning",
                            access_log=False, timeout_keep_alive=HTTP_IDLE_CONNECTION_KEPT_S)
    follower.start()
    try:
        _Server(config, on_listening).run()
    except KeyboardInterrupt:  # as uvicorn.run: a second Ctrl-C during the drain
        pass
    finally:
        _stop_follower_now(follower)  # when startup failed, or a second Ctrl-C cut the shutdown short
        ledger.close()


async def _stop_follower(app: Litestar) -> None:
    await asyncio.to_thread(_stop_follower_now, app.state.read_model_follower)  # it waits for a page: not on the loop


def _stop_follower_now(follower: ReadModelFollower) -> None:
    if not follower.stop():
        logging.getLogger("paralon.read_models").error("the read models' follower did not stop in time")
