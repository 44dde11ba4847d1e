"""The management API: the account, its API keys, workers, top-ups, usage and
earnings, for management tokens (`Authorization: Bearer pt-par-…`).

A token acts for its own account only; what belongs to another account
answers 404, exactly as what does not exist. Each route says which roles may
call it (app/http/guards.py); the handler translates HTTP to one call of the
functions the CLI also uses (app/accounts.py, app/payments/)."""
from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Annotated

from litestar import Controller, Request, Response, delete, get, post, put
from litestar.params import FromPath, FromQuery, QueryParameter

from app import accounts
from app.http.errors import SERVICE_EXCEPTION_HANDLERS, about_field
from app.http.guards import (
    PRINCIPAL,
    Caller,
    requires_admin,
    requires_any_role,
    requires_customer,
    requires_customer_or_admin,
    requires_owner_or_admin,
    requires_reader,
)
from app.http.openapi import MANAGEMENT_TOKEN
from app.http.plumbing import PathId, QueryId, json_object, json_response, read, usd_text, write
from app.limits import ACCOUNTS_PAGE_ROWS_DEFAULT, ACCOUNTS_PAGE_ROWS_MAX, CHECKOUT_RETRY_WINDOW_S
from app.payments import deposits as stablecoin_deposits
from app.payments.chain_settings import CryptoSettings
from app.payments import stripe as stripe_payments
from app.platform import platform_status
from ledger.limits import INT64_MAX
from ledger.money import usd_to_nano_usd
from proxy.errors import InvalidRequest

RESUMED_REASON_DEFAULT = "resumed by an administrator"
SinceDay = Annotated[str | None, QueryParameter(pattern=r"^\d{4}-\d{2}-\d{2}$", description="YYYY-MM-DD, UTC: the first day counted")]


class AccountController(Controller):
    """The token's own account, its API keys and its top-ups (an admin's: any account's)."""

    path = "/v1"
    tags = ["account"]
    security = MANAGEMENT_TOKEN
    dependencies = PRINCIPAL
    exception_handlers = SERVICE_EXCEPTION_HANDLERS

    @get("/account", guards=[requires_any_role], summary="The token's own account and its balances")
    async def get_account(self, request: Request, who: Caller) -> Response:
        return json_response(await read(request, accounts.account_view, who))

    @get("/account/low-balance-alert", guards=[requires_reader],
         summary="The account's low-balance alert: its threshold (null: off) and whether it was alerted")
    async def get_low_balance_alert(self, request: Request, who: Caller, account_id: QueryId = None) -> Response:
        return json_response(await read(request, accounts.low_balance_alert, who, account_id))

    @put("/account/low-balance-alert", guards=[requires_customer],
         summary="Email the account once its available balance falls below a threshold (null turns it off)")
    async def set_low_balance_alert(self, request: Request, who: Caller, account_id: QueryId = None) -> Response:
        """Body: {"threshold_usd": "2.00"} (two decimals at most, above zero) or {"threshold_usd": null}."""
        body = await json_object(request)
        if "threshold_usd" not in body:
            raise InvalidRequest('send {"threshold_usd": "2.00"}, or null to turn the alert off', param="threshold_usd")
        with about_field("threshold_usd"):
            view = await write(request, accounts.set_low_balance_alert, who, account_id, body["threshold_usd"])
        return json_response(view)

    @get("/keys", guards=[requires_reader], summary="API keys of the account")
    async def list_keys(self, request: Request, who: Caller, account_id: QueryId = None) -> Response:
        return json_response({"data": await read(request, accounts.list_keys, who, account_id)})

    @post("/keys", guards=[requires_customer], summary="Create an API key (shown once)", status_code=201)
    async def create_key(self, request: Request, who: Caller) -> Response:
        """Body: {"name": "…", "spend_limit_usd": "5.00"}, both optional."""
        body = await json_object(request)
        limit_usd = body.get("spend_limit_usd")
        with about_field("spend_limit_usd"):
            limit = usd_to_nano_usd(usd_text(limit_usd, "spend_limit_usd")) if limit_usd is not None else None
        return json_response(await write(request, accounts.create_key, who, body.get("name"), limit), 201)

    @delete("/keys/{key_id:int}", guards=[requires_customer_or_admin], summary="Revoke an API key", status_code=200)
    async def revoke_key(self, request: Request, who: Caller, key_id: PathId) -> Response:
        await write(request, accounts.revoke_key, who, key_id)
        request.app.state.directory.evict_key(key_id)  # this process at once; other replicas hear of it from the database
        return json_response({"id": key_id, "revoked": True})

    @post("/credits/checkout", guards=[requires_customer], status_code=201,
          summary="Start a card top-up: a Stripe Checkout session for the caller's account")
    async def create_checkout(self, request: Request, who: Caller) -> Response:
        """Body: {"amount_usd": "25.00"}; an Idempotency-Key header makes retries safe."""
        body = await json_object(request)
        if "amount_usd" not in body:
            raise InvalidRequest('send {"amount_usd": "25.00"}', param="amount_usd")
        amount_usd = usd_text(body["amount_usd"], "amount_usd")
        caller_key = request.headers.get("idempotency-key") or f"{who.actor}:{int(time.time()) // CHECKOUT_RETRY_WINDOW_S}"
        with about_field("amount_usd"):
            session = await asyncio.to_thread(stripe_payments.create_checkout, request.app.state.ledger.engine,
                                              request.app.state.stripe, who.account_id, amount_usd, caller_key)
        return json_response(session, 201)

    @get("/credits/crypto/address", guards=[requires_customer], summary="The caller's own stablecoin deposit address")
    async def crypto_address(self, request: Request, who: Caller) -> Response:
        engine, settings = request.app.state.ledger.engine, request.app.state.crypto

        def work() -> dict:
            address = stablecoin_deposits.deposit_address(engine, settings, who.account_id)
            return {"address": address, "chain_id": _chain_id(settings)}

        return json_response(await asyncio.to_thread(work))

    @get("/credits/crypto/deposits", guards=[requires_reader],
         summary="Stablecoin deposits seen on chain and not yet credited, with their confirmations")
    async def crypto_deposits(self, request: Request, who: Caller, account_id: QueryId = None) -> Response:
        account, required = accounts.scoped_account(who, account_id), request.app.state.crypto.confirmations
        return json_response({"data": await read(request, stablecoin_deposits.pending_deposits, account, required)})

    @get("/usage", guards=[requires_reader], summary="Usage of the account from the read models, grouped by day, model or key")
    async def usage(self, request: Request, who: Caller, group_by: FromQuery[str] = "day",
                    since: SinceDay = None, account_id: QueryId = None) -> Response:
        """`group_by` may name two dimensions (`day,model`); `since` is the first day counted."""
        with about_field("group_by"):
            rows = await read(request, accounts.usage, accounts.scoped_account(who, account_id), group_by, since)
        return json_response({"data": rows})

    @get("/usage/summary", guards=[requires_reader],
         summary="Spend today, over 7 and 30 days, and the days the available credits last at the last week's rate")
    async def usage_summary(self, request: Request, who: Caller, account_id: QueryId = None) -> Response:
        account = accounts.scoped_account(who, account_id)
        return json_response(await read(request, accounts.usage_summary, account, datetime.now(UTC).date()))

    @get("/earnings", guards=[requires_owner_or_admin],
         summary="Earnings of the owner from the read models, grouped by day, worker or model")
    async def earnings(self, request: Request, who: Caller, group_by: FromQuery[str] = "day",
                       since: SinceDay = None, account_id: QueryId = None) -> Response:
        """`group_by` may name two dimensions (`day,worker`); `since` is the first day counted."""
        with about_field("group_by"):
            rows = await read(request, accounts.earnings, accounts.scoped_account(who, account_id), group_by, since)
        return json_response({"data": rows})

    @get("/earnings/summary", guards=[requires_owner_or_admin], summary="Earnings today and over 7 and 30 days")
    async def earnings_summary(self, request: Request, who: Caller, account_id: QueryId = None) -> Response:
        account = accounts.scoped_account(who, account_id)
        return json_response(await read(request, accounts.earnings_summary, account, datetime.now(UTC).date()))


class WorkerController(Controller):
    """An owner's workers (an admin's: every worker)."""

    path = "/v1/workers"
    tags = ["workers"]
    security = MANAGEMENT_TOKEN
    dependencies = PRINCIPAL
    exception_handlers = SERVICE_EXCEPTION_HANDLERS

    @get("/", guards=[requires_owner_or_admin], summary="Workers of the owner (all of them for an admin)")
    async def list_workers(self, request: Request, who: Caller) -> Response:
        return json_response({"data": await read(request, accounts.list_workers, who)})

    @post("/{worker_id:int}/drain", guards=[requires_owner_or_admin], status_code=200,
          summary="Drain a worker: no new requests, in-flight ones finish")
    async def drain_worker(self, request: Request, who: Caller, worker_id: PathId) -> Response:
        return json_response(await write(request, accounts.drain_worker, who, worker_id))

    @post("/{worker_id:int}/resume", guards=[requires_admin], status_code=200,
          summary="Resume a suspended worker (admins): its strikes start again from zero")
    async def resume_worker(self, request: Request, who: Caller, worker_id: PathId) -> Response:
        """Body (optional): {"reason": "…"}. A draining or drained worker is not resumed (409)."""
        body = await json_object(request)
        reason = body.get("reason", RESUMED_REASON_DEFAULT)
        return json_response(await write(request, accounts.resume_worker, who, worker_id, reason))


PageRows = Annotated[int, QueryParameter(ge=1, le=ACCOUNTS_PAGE_ROWS_MAX, description="accounts per page")]
AfterId = Annotated[int, QueryParameter(ge=0, le=INT64_MAX, description="the last id of the page before (next_after_id)")]


class PlatformController(Controller):
    """The whole platform, for admins: its state, and every account."""

    path = "/v1"
    tags = ["platform"]
    security = MANAGEMENT_TOKEN
    dependencies = PRINCIPAL
    exception_handlers = SERVICE_EXCEPTION_HANDLERS

    @get("/platform/status", guards=[requires_admin],
         summary="Read-model lag, the last scheduled ledger verification, workers by state, accounts by kind (admins)")
    async def status(self, request: Request, who: Caller) -> Response:
        return json_response(await asyncio.to_thread(platform_status, request.app.state.ledger.engine))

    @get("/accounts", guards=[requires_admin], summary="Every account with its balances, in id order, a page at a time (admins)")
    async def list_accounts(self, request: Request, who: Caller, limit: PageRows = ACCOUNTS_PAGE_ROWS_DEFAULT,
                            after_id: AfterId = 0) -> Response:
        """`next_after_id` (null on the last page) is the `after_id` of the next page."""
        return json_response(await read(request, accounts.list_accounts, who, after_id, limit))


MANAGEMENT_CONTROLLERS = [AccountController, WorkerController, PlatformController]


def _chain_id(settings: CryptoSettings) -> int | None:
    """The id of the chain deposits go to, from its node. Runs in a worker thread;
    web3 is loaded at start wherever a node is set (app.wiring.crypto_settings)."""
    if not settings.rpc_url:
        return None
    from app.payments import crypto

    return crypto.connect(settings).eth.chain_id
