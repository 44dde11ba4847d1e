"""The HTTP service: one Litestar app with the OpenAI API, the management API,
documents, webhooks and operator endpoints, and the background work of one
proxy replica (worker directory, health probes, hold renewal and sweeping)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime

import httpx
from litestar import Litestar
from litestar.datastructures import CacheControlHeader
from litestar.static_files import create_static_files_router

from app import wiring
from app.console.signin import ConsoleSettings
from app.http.activity import ActivityController
from app.http.console.account_pages import AccountPages
from app.http.console.sign_in_pages import SignInController, checkout_return
from app.http.console.web import STATIC_DIR
from app.http.completions_entry import CompletionsEntry
from app.http.documents import DocumentController
from app.http.embeddings import EmbeddingsController
from app.http.errors import EXCEPTION_HANDLERS
from app.http.inference import InferenceController, browser_cors
from app.http.management import MANAGEMENT_CONTROLLERS
from app.http.payouts import PayoutController
from app.http.openapi import ASSETS_PATH, complete_openapi, openapi_config, swagger_ui_assets
from app.http.responses import ResponsesController
from app.http.status import RoutingState, health, metrics, metrics_registry, ready
from app.http.webhooks import stripe_webhook
from app.jobs.embedded_beat import run_embedded_beat
from app.payments.chain_settings import CryptoSettings
from app.payments.stripe import StripeSettings
from app.limits import (
    CONSOLE_STATIC_MAX_AGE_S,
    HOLD_SWEEP_INTERVAL_S,
    ORPHANED_HOLDS_WAIT_S,
    UPSTREAM_CONNECTIONS_MAX,
    UPSTREAM_POOL_TIMEOUT_S,
    UPSTREAM_READ_TIMEOUT_S,
    UPSTREAM_WRITE_TIMEOUT_S,
)
from app.settings import Settings
from invoices.service import InvoiceSettings
from ledger.db import is_postgres
from ledger.limits import HOLD_TTL_S_DEFAULT
from ledger.service import Ledger
from proxy.directory import Directory
from proxy.health import HealthChecker
from proxy.limits import CAPACITY_PERIOD_S, HEALTH_INTERVAL_S, KEY_CACHE_TTL_S, UPSTREAM_CONNECT_TIMEOUT_S
from proxy.responses.relay import ResponsesProxy
from proxy.revocations import follow_revocations
from proxy.routing import AFFINITY
from proxy.withheld import WithheldJournal
from proxy.upstream import UpstreamPool

log = logging.getLogger(__name__)

STATIC_CACHE = CacheControlHeader(max_age=CONSOLE_STATIC_MAX_AGE_S)
UPSTREAM_TIMEOUT = httpx.Timeout(connect=UPSTREAM_CONNECT_TIMEOUT_S, read=UPSTREAM_READ_TIMEOUT_S,
                                 write=UPSTREAM_WRITE_TIMEOUT_S, pool=UPSTREAM_POOL_TIMEOUT_S)


def create_app(ledger: Ledger, *, key_cache_ttl_s: float = KEY_CACHE_TTL_S,
               health_interval_s: float = HEALTH_INTERVAL_S, hold_ttl_s: int = HOLD_TTL_S_DEFAULT,
               hold_sweep_interval_s: float = HOLD_SWEEP_INTERVAL_S,
               stripe_settings: StripeSettings | None = None, crypto_settings: CryptoSettings | None = None,
               invoice_settings: InvoiceSettings | None = None, embedded_beat: bool = False,
               worker_ca_bundle_path: str | None = None, replica_id: str | None = None,
               withheld_journal_path: str | None = None, capacity_period_s: float = CAPACITY_PERIOD_S,
               routing_policy: str = AFFINITY, console_settings: ConsoleSettings | None = None,
               hold_pools: bool = True) -> Litestar:
    """Settings left out are read from the environment (app/wiring.py). The
    holds this replica places carry `replica_id`; as it starts, it settles those
    its crashed run left under it (none when None)."""
    directory = Directory(ledger.engine, key_cache_ttl_s=key_cache_ttl_s, routing_policy=routing_policy)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        upstream = UpstreamPool(ca_bundle_path=worker_ca_bundle_path)  # https:// workers on a private CA
        client = httpx.AsyncClient(verify=upstream.tls_context, timeout=UPSTREAM_TIMEOUT,
                                   limits=httpx.Limits(max_connections=UPSTREAM_CONNECTIONS_MAX,
                                                       max_keepalive_connections=UPSTREAM_CONNECTIONS_MAX))
        orphans = await asyncio.to_thread(ledger.holds_of_replica, replica_id) if replica_id else {}
        await directory.refresh_async()
        checker = HealthChecker(directory, client, interval_s=health_interval_s, period_s=capacity_period_s)
        await checker.check_all()
        app.state.directory = directory
        app.state.proxy = ResponsesProxy(ledger, directory, upstream, hold_ttl_s=hold_ttl_s, replica_id=replica_id,
                                         journal=WithheldJournal(withheld_journal_path) if withheld_journal_path else None,
                                         hold_pools=hold_pools)
        app.state.proxy.settler.resume_withheld()
        background = (directory.run(), checker.run(), _sweep_holds(ledger, hold_sweep_interval_s), app.state.proxy.keep_holds(),
                      app.state.proxy.record_unbilled(), _settle_orphans(ledger, replica_id, orphans))
        tasks = [asyncio.create_task(work) for work in background]
        if is_postgres(ledger.engine):  # on SQLite the API evicts what it revokes; the CLI waits for the TTL
            tasks.append(asyncio.create_task(follow_revocations(ledger.engine, directory.on_revoked, directory.forget_keys)))
        if embedded_beat:
            tasks.append(asyncio.create_task(run_embedded_beat()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await app.state.proxy.drain_background()
            upstream.close()
            await client.aclose()

    app = Litestar(
        route_handlers=[InferenceController, ResponsesController, EmbeddingsController, *MANAGEMENT_CONTROLLERS, PayoutController, ActivityController,
                        DocumentController, stripe_webhook, health, ready, metrics, SignInController, AccountPages, checkout_return,
                        create_static_files_router(path=ASSETS_PATH, directories=[swagger_ui_assets()], include_in_schema=False),
                        create_static_files_router(path="/console/static", directories=[STATIC_DIR], include_in_schema=False,
                                                   cache_control=STATIC_CACHE)],
        lifespan=[lifespan],
        on_startup=[complete_openapi],
        exception_handlers=EXCEPTION_HANDLERS,
        openapi_config=openapi_config(),
        cors_config=browser_cors(Settings.from_env()),
    )
    CompletionsEntry.install(app)
    settings = None if stripe_settings and crypto_settings and invoice_settings and console_settings else Settings.from_env()
    app.state.ledger = ledger
    app.state.stripe = stripe_settings or wiring.stripe_settings(settings)
    app.state.crypto = crypto_settings or wiring.crypto_settings(settings)
    app.state.invoices = invoice_settings or wiring.invoice_settings(settings)
    app.state.console = console_settings or wiring.console_settings(settings)
    app.state.payout_rules = wiring.payout_rules(settings or Settings.from_env())
    app.state.metrics = metrics_registry(ledger.engine)
    app.state.metrics.register(RoutingState(directory))
    app.state.redis_url = wiring.redis_url(settings or Settings.from_env())  # /ready pings it when one is configured
    app.state.background = set()  # webhook processing in flight: kept so the tasks are not collected mid-way
    return app


async def _settle_orphans(ledger: Ledger, replica_id: str | None, seen: dict[int, datetime]) -> None:
    """Settle the holds this replica's crashed run left (`seen` as it started,
    before it placed any) at once, rather than after they expire: released, or
    settled at the usage recorded against them. Those renewed meanwhile are
    another live process's under the same id, and are left to it."""
    if not seen:
        return
    await asyncio.sleep(ORPHANED_HOLDS_WAIT_S)
    try:
        done = await asyncio.to_thread(ledger.settle_orphaned_holds, seen)
    except Exception:  # the database is away: the sweeper closes them once they expire
        log.warning("could not settle the holds replica %s left before it restarted", replica_id, exc_info=True)
        return
    log.info("replica %s: of the holds it left before it restarted, %d settled, %d released",
             replica_id, done.settled, done.released)
    in_use = set(seen) & set(await asyncio.to_thread(ledger.holds_of_replica, replica_id))
    if in_use:
        log.error("replica id %s: %d of its holds are renewed by another running process; give each replica "
                  "its own PARALON_REPLICA_ID", replica_id, len(in_use))


async def _sweep_holds(ledger: Ledger, interval_s: float) -> None:
    """Close holds a crashed proxy left behind, once they expire: released, or
    settled at the recorded usage."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(ledger.expire_holds)
        except Exception:  # the database may be away for a moment: the next round tries again
            continue
