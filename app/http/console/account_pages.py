"""The pages of one account: what a customer, a GPU owner, an accountant and a
platform admin see. Each handler reads through the same service functions as
the management API route named beside it, with the signed-in member's rights,
and holds no query of its own."""
from __future__ import annotations

import asyncio
import secrets
from datetime import UTC, datetime
from typing import NamedTuple
from urllib.parse import urlencode

from litestar import Controller, Request, Response, get, post
from litestar.handlers import HTTPRouteHandler
from litestar.response import Redirect
from litestar.types import Guard

from app import accounts
from app.activity import STATUSES as ACTIVITY_STATUSES
from app.activity import activity
from app.http import documents
from app.http.console import charts
from app.http.console.web import CONSOLE_EXCEPTION_HANDLERS, BadForm, NotThere, console_guard, page, security_headers, viewer_of
from app.http.guards import (
    requires_admin,
    requires_any_role,
    requires_customer,
    requires_customer_or_admin,
    requires_owner_or_admin,
    requires_reader,
)
from app.http.plumbing import PathId, PathName, read, write
from app.limits import ACCOUNTS_PAGE_ROWS_DEFAULT, CHECKOUT_NONCE_BYTES
from app.members import members_of_accounts
from app.payments import deposits as stablecoin_deposits
from app.payments import stripe as stripe_payments
from app.platform import platform_status
from app.tokens import Principal
from invoices import statements
from ledger import commands as cmd
from ledger.errors import InvalidInput, LedgerError
from ledger.money import usd_to_nano_usd
from proxy.prices import load_prices

CUSTOMER_KIND, OWNER_KIND, PLATFORM_KIND = (cmd.CUSTOMER,), (cmd.OWNER,), (cmd.PLATFORM,)
EVERY_KIND = (cmd.CUSTOMER, cmd.OWNER)


class NavItem(NamedTuple):
    label: str
    suffix: str
    guard: Guard
    kinds: tuple[str, ...]


# The tabs of an account, in order; the first a role may open is its home.
NAV = (
    NavItem("Overview", "overview", requires_reader, CUSTOMER_KIND),
    NavItem("Activity", "activity", requires_reader, CUSTOMER_KIND),
    NavItem("API keys", "keys", requires_reader, CUSTOMER_KIND),
    NavItem("Top up", "top-up", requires_customer, CUSTOMER_KIND),
    NavItem("Alerts", "alerts", requires_reader, CUSTOMER_KIND),
    NavItem("Earnings", "earnings", requires_owner_or_admin, OWNER_KIND),
    NavItem("Workers", "workers", requires_owner_or_admin, OWNER_KIND),
    NavItem("Documents", "documents", requires_any_role, EVERY_KIND),
    NavItem("Reconciliation", "reconciliation", requires_any_role, EVERY_KIND),
    NavItem("Fleet", "fleet", requires_admin, PLATFORM_KIND),
    NavItem("Accounts", "accounts", requires_admin, PLATFORM_KIND),
    NavItem("Models", "models", requires_admin, PLATFORM_KIND),
    NavItem("Status", "status", requires_admin, PLATFORM_KIND),
)


def nav_for(principal: Principal, kind: str) -> list[dict]:
    return [{"label": item.label, "href": f"/console/{principal.account_id}/{item.suffix}"}
            for item in NAV if kind in item.kinds and principal.role in item.guard.roles]


def console_page(path: str, guard: Guard, kinds: tuple[str, ...], method=get) -> HTTPRouteHandler:
    """A route of an account's pages: signed in, allowed to see the account, of its role and kind."""
    return method(path, guards=[console_guard], opt={"guard": guard, "kinds": kinds})


def account_page(request: Request, template: str, **context) -> Response:
    viewer = viewer_of(request)
    return page(request, template, nav=nav_for(viewer.principal, viewer.account["kind"]), **context)


def who(request: Request) -> Principal:
    return viewer_of(request).principal


def today() -> datetime:
    return datetime.now(UTC)


class AccountPages(Controller):
    path = "/console/{account_id:int}"
    include_in_schema = False
    exception_handlers = CONSOLE_EXCEPTION_HANDLERS
    after_request = security_headers

    @get("/", guards=[console_guard], opt={"guard": requires_any_role, "kinds": (*EVERY_KIND, cmd.PLATFORM)})
    async def home(self, request: Request, account_id: PathId) -> Response:
        tabs = nav_for(who(request), viewer_of(request).account["kind"])
        if not tabs:
            raise NotThere()
        return Redirect(tabs[0]["href"])

    # --- A customer's ---------------------------------------------------------------

    @console_page("/overview", requires_reader, CUSTOMER_KIND)  # GET /v1/account, /v1/usage/summary, /v1/usage
    async def overview(self, request: Request, account_id: PathId) -> Response:
        day = today().date()
        seen = await read(request, accounts.usage_overview, who(request), day)  # what those give, in one read
        return account_page(request, "overview.html", title="Overview", balance=seen["balance"], summary=seen["summary"],
                            chart=charts.daily_series(seen["by_day_model"], "model", "cost_nano_usd", day),
                            by_model=seen["by_model"])

    @console_page("/keys", requires_reader, CUSTOMER_KIND)  # GET /v1/keys, /v1/usage?group_by=key
    async def keys(self, request: Request, account_id: PathId) -> Response:
        return await self._keys_page(request, account_id)

    async def _keys_page(self, request: Request, account_id: int, created: dict | None = None, status: int = 200) -> Response:
        listed = await read(request, accounts.list_keys, who(request), account_id)
        spent = {row["key"]: row["cost_nano_usd"] for row in await read(request, accounts.usage, account_id, "key")}
        response = account_page(request, "keys.html", title="API keys", keys=listed, spent=spent, created=created)
        response.status_code = status
        return response

    @console_page("/keys", requires_customer, CUSTOMER_KIND, method=post)  # POST /v1/keys
    async def create_key(self, request: Request, account_id: PathId) -> Response:
        form = await request.form()
        limit_text = (form.get("spend_limit_usd") or "").strip()
        try:
            limit = usd_to_nano_usd(limit_text) if limit_text else None
            created = await write(request, accounts.create_key, who(request), form.get("name") or None, limit)
        except (InvalidInput, LedgerError) as exc:
            raise BadForm(str(exc)) from None
        return await self._keys_page(request, account_id, created=created, status=201)

    @console_page("/keys/{key_id:int}/revoke", requires_customer_or_admin, CUSTOMER_KIND, method=post)  # DELETE /v1/keys/{id}
    async def revoke_key(self, request: Request, account_id: PathId, key_id: PathId) -> Response:
        if key_id not in {k["id"] for k in await read(request, accounts.list_keys, who(request), account_id)}:
            raise NotThere()  # an admin's principal reaches every key: the page is about this account's
        await write(request, accounts.revoke_key, who(request), key_id)
        request.app.state.directory.evict_key(key_id)
        return Redirect(f"/console/{account_id}/keys")

    @console_page("/activity", requires_reader, CUSTOMER_KIND)  # GET /v1/activity
    async def activity(self, request: Request, account_id: PathId) -> Response:
        """Every request, newest first; htmx asks for what is new every few seconds (`/activity/rows`)."""
        filters = _activity_filters(request)
        try:
            found = await read(request, lambda conn: activity(conn, who(request), account_id, **filters,
                                                              before=request.query_params.get("before") or None))
        except LedgerError as exc:
            raise BadForm(str(exc)) from None
        listed = await read(request, accounts.list_keys, who(request), account_id)
        models = [row["model"] for row in await read(request, accounts.usage, account_id, "model")]
        return account_page(request, "activity.html", title="Activity", page=found, filters=filters, keys=listed,
                            models=models, statuses=ACTIVITY_STATUSES, query=_query_text(filters))

    @console_page("/activity/rows", requires_reader, CUSTOMER_KIND)  # GET /v1/activity?after=
    async def activity_rows(self, request: Request, account_id: PathId) -> Response:
        filters = _activity_filters(request)
        after = request.query_params.get("after") or None
        try:
            found = await read(request, lambda conn: activity(conn, who(request), account_id, **filters, after=after))
        except LedgerError as exc:
            raise BadForm(str(exc)) from None
        return account_page(request, "_activity_rows.html", page=found, filters=filters, query=_query_text(filters),
                            after=found["after"] or after)

    @console_page("/alerts", requires_reader, CUSTOMER_KIND)  # GET /v1/account/low-balance-alert
    async def alerts(self, request: Request, account_id: PathId) -> Response:
        alert = await read(request, accounts.low_balance_alert, who(request), account_id)
        return account_page(request, "alerts.html", title="Low-balance alert", alert=alert)

    @console_page("/alerts", requires_customer, CUSTOMER_KIND, method=post)  # PUT /v1/account/low-balance-alert
    async def set_alert(self, request: Request, account_id: PathId) -> Response:
        form = await request.form()
        threshold = None if form.get("off") else (form.get("threshold_usd") or "").strip()
        try:
            await write(request, accounts.set_low_balance_alert, who(request), account_id, threshold)
        except LedgerError as exc:
            raise BadForm(str(exc)) from None
        return Redirect(f"/console/{account_id}/alerts")

    @console_page("/top-up", requires_customer, CUSTOMER_KIND)  # GET /v1/credits/crypto/address, …/deposits
    async def top_up(self, request: Request, account_id: PathId) -> Response:
        settings = request.app.state.crypto
        address = deposits = None
        if settings.seed:
            address = await asyncio.to_thread(stablecoin_deposits.deposit_address, request.app.state.ledger.engine, settings, account_id)
            deposits = await read(request, stablecoin_deposits.pending_deposits, account_id, settings.confirmations)
        stripe = request.app.state.stripe
        return account_page(request, "top_up.html", title="Top up", address=address, deposits=deposits,
                            qr=charts.qr_svg_data_uri(address) if address else None,
                            card=bool(stripe.secret_key), nonce=secrets.token_hex(CHECKOUT_NONCE_BYTES), min_cents=stripe.checkout_min_cents,
                            max_cents=stripe.checkout_max_cents)

    @console_page("/top-up/card", requires_customer, CUSTOMER_KIND, method=post)  # POST /v1/credits/checkout
    async def top_up_card(self, request: Request, account_id: PathId) -> Response:
        form = await request.form()
        try:
            session = await asyncio.to_thread(stripe_payments.create_checkout, request.app.state.ledger.engine,
                                              request.app.state.stripe, account_id, form.get("amount_usd", ""),
                                              f"{who(request).actor}:{form.get('nonce', '')}")
        except LedgerError as exc:
            raise BadForm(str(exc)) from None
        # A page that moves on to Stripe, not a redirect: Chromium holds a form's redirects to the page's
        # CSP form-action ('self'), and Stripe's Checkout host (or a custom domain) is not known beforehand.
        return account_page(request, "checkout.html", title="Pay by card", checkout_url=session["url"])

    # --- Documents: customers, accountants and owners ---------------------------------

    @console_page("/documents", requires_any_role, EVERY_KIND)  # GET /v1/invoices, /v1/statements
    async def documents(self, request: Request, account_id: PathId) -> Response:
        params = request.query_params
        period_from, period_to, kind = params.get("from") or None, params.get("to") or None, params.get("kind") or None
        invoices = None
        if who(request).role in requires_reader.roles and viewer_of(request).account["kind"] == cmd.CUSTOMER:
            try:
                start = documents.period_bound(period_from, "from")
                end = documents.period_bound(period_to, "to")
                invoices = await read(request, accounts.list_invoices, account_id, kind, start, end)
            except LedgerError as exc:
                raise BadForm(str(exc)) from None
        listed = await read(request, documents.statements.list_statements, account_id)
        return account_page(request, "documents.html", title="Documents", invoices=invoices, statements=listed,
                            period_from=period_from or "", period_to=period_to or "", kind=kind or "",
                            this_month=today().strftime("%Y-%m"))

    @console_page("/invoices/{name:str}", requires_reader, CUSTOMER_KIND)  # GET /v1/invoices/{name}
    async def invoice_pdf(self, request: Request, account_id: PathId, name: PathName) -> Response:
        return await documents.invoice_pdf_response(request, _own_account_only(who(request)), name)

    @console_page("/statements/{name:str}", requires_any_role, EVERY_KIND)  # GET /v1/statements/{name}
    async def statement(self, request: Request, account_id: PathId, name: PathName) -> Response:
        return await documents.statement_response(request, account_id, name)

    @console_page("/exports/ledger.csv", requires_any_role, EVERY_KIND)  # GET /v1/exports/ledger.csv
    async def ledger_export(self, request: Request, account_id: PathId) -> Response:
        params = request.query_params
        return await documents.ledger_export_response(request, account_id, params.get("from") or None, params.get("to") or None)

    @console_page("/invoices.zip", requires_reader, CUSTOMER_KIND)  # GET /v1/invoices.zip
    async def documents_zip(self, request: Request, account_id: PathId) -> Response:
        params = request.query_params
        return await documents.documents_zip_response(request, account_id, params.get("from", ""), params.get("to", ""),
                                                      params.get("kind") or None)

    @console_page("/reconciliation", requires_any_role, EVERY_KIND)  # GET /v1/reconciliation
    async def reconciliation(self, request: Request, account_id: PathId) -> Response:
        month = today().strftime("%Y-%m")
        period_from = request.query_params.get("from") or month
        period_to = request.query_params.get("to") or next_month(month)
        figures = await documents.reconciliation_figures(request, account_id, period_from, period_to)
        return account_page(request, "reconciliation.html", title="Reconciliation", figures=figures,
                            period_from=period_from, period_to=period_to)

    # --- An owner's -------------------------------------------------------------------

    @console_page("/earnings", requires_owner_or_admin, OWNER_KIND)  # GET /v1/earnings/summary, /v1/earnings
    async def earnings(self, request: Request, account_id: PathId) -> Response:
        day = today().date()
        seen = await read(request, accounts.earnings_overview, account_id, day)  # what those give, in one read
        summary, by_worker, by_model = seen["summary"], seen["by_day_worker"], seen["by_day_model"]
        return account_page(request, "earnings.html", title="Earnings", summary=summary,
                            worker_chart=charts.daily_series(by_worker, "worker", "earnings_nano_usd", day),
                            model_chart=charts.daily_series(by_model, "model", "earnings_nano_usd", day),
                            per_worker=charts.totals(by_worker, "worker", "earnings_nano_usd"))

    @console_page("/workers", requires_owner_or_admin, OWNER_KIND)  # GET /v1/workers
    async def workers(self, request: Request, account_id: PathId) -> Response:
        template = "_workers_table.html" if request.headers.get("hx-request") else "workers.html"
        return account_page(request, template, title="Workers", workers=await self._workers_of(request, account_id))

    @console_page("/workers/{worker_id:int}/drain", requires_owner_or_admin, OWNER_KIND, method=post)  # POST /v1/workers/{id}/drain
    async def drain(self, request: Request, account_id: PathId, worker_id: PathId) -> Response:
        if worker_id not in {w["id"] for w in await self._workers_of(request, account_id)}:
            raise NotThere()
        await write(request, accounts.drain_worker, who(request), worker_id)
        return Redirect(f"/console/{account_id}/workers")

    async def _workers_of(self, request: Request, account_id: int) -> list[dict]:
        listed = await read(request, accounts.list_workers, who(request))
        return [w for w in listed if w["owner_account_id"] == account_id]  # an admin's list holds every owner's

    # --- The platform's ---------------------------------------------------------------

    @console_page("/fleet", requires_admin, PLATFORM_KIND)  # GET /v1/workers (admin)
    async def fleet(self, request: Request, account_id: PathId) -> Response:
        listed = await read(request, accounts.list_workers, who(request))
        template = "_fleet_table.html" if request.headers.get("hx-request") else "fleet.html"
        return account_page(request, template, title="Fleet", workers=listed)

    @console_page("/accounts", requires_admin, PLATFORM_KIND)  # GET /v1/accounts
    async def accounts_list(self, request: Request, account_id: PathId) -> Response:
        after_text = request.query_params.get("after_id") or "0"
        after_id = int(after_text) if after_text.isdigit() else 0
        page_of = await read(request, accounts.list_accounts, who(request), after_id, ACCOUNTS_PAGE_ROWS_DEFAULT)
        members = await read(request, members_of_accounts, [row["id"] for row in page_of["data"]])
        return account_page(request, "accounts.html", title="Accounts", page=page_of, members=members)

    @console_page("/status", requires_admin, PLATFORM_KIND)  # GET /v1/platform/status
    async def status(self, request: Request, account_id: PathId) -> Response:
        status = await asyncio.to_thread(platform_status, request.app.state.ledger.engine)
        return account_page(request, "status.html", title="Platform status", platform=status)

    @console_page("/models", requires_admin, PLATFORM_KIND)  # GET /v1/models
    async def models(self, request: Request, account_id: PathId) -> Response:
        prices = await read(request, load_prices)
        return account_page(request, "models.html", title="Models and prices", prices=sorted(prices.items()))


def _activity_filters(request: Request) -> dict:
    """The page's filters as the service takes them; a bad one is the service's to refuse."""
    params = request.query_params
    key_text = params.get("key_id") or ""
    return {"model": params.get("model") or None, "status": params.get("status") or None,
            "api_key_id": int(key_text) if key_text.isdigit() else (key_text or None)}


def _query_text(filters: dict) -> str:
    return urlencode({("key_id" if name == "api_key_id" else name): value for name, value in filters.items() if value})


def next_month(month: str) -> str:
    return statements.parse_month(month).end.strftime("%Y-%m")


def _own_account_only(principal: Principal) -> Principal:
    """An invoice is looked up by its number: on an account's page, only that account's are there."""
    return principal._replace(role="viewer") if principal.is_admin else principal
