"""Owners' payouts over HTTP: ask for one, follow it, download its receipt,
and say where each rail pays. An owner's token acts on its own account only;
an admin reads any owner's (`?account_id=`). Handlers call app/payments/payouts.py,
as `paralon payouts` does."""
from __future__ import annotations

import asyncio

from litestar import Controller, Request, Response, get, post, put

from app import accounts, outbox
from app.http.errors import SERVICE_EXCEPTION_HANDLERS, about_field
from app.http.guards import PRINCIPAL, Caller, requires_owner, requires_owner_or_admin
from app.http.openapi import MANAGEMENT_TOKEN
from app.jobs.celery import send_task
from app.http.plumbing import PathName, QueryId, json_object, json_response, read, usd_text
from app.payments import payout_receipts
from app.payments import payouts as po
from ledger.limits import INT64_MAX
from ledger.money import usd_to_nano_usd
from ledger.schema import utc_now
from proxy.errors import InvalidRequest

PDF_SUFFIX = ".pdf"


def _text_field(body: dict, name: str, example: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise InvalidRequest(f'send {{"{name}": "{example}", …}}', param=name)
    return value


class PayoutController(Controller):
    path = "/v1/payouts"
    tags = ["payouts"]
    security = MANAGEMENT_TOKEN
    dependencies = PRINCIPAL
    exception_handlers = SERVICE_EXCEPTION_HANDLERS

    @post("/", guards=[requires_owner], status_code=202,
          summary="Ask for a payout of earnings on a rail (usdc or stripe); its sender pays it")
    async def request_payout(self, request: Request, who: Caller) -> Response:
        """Body: {"amount_usd": "50.00", "rail": "usdc"}. The amount is rounded down to what the rail
        moves (a micro-USDC, a cent); the rest stays in earnings. 409 while another is in flight on the rail."""
        body = await json_object(request)
        rail = _text_field(body, "rail", "usdc")
        with about_field("amount_usd"):
            amount = usd_to_nano_usd(usd_text(body.get("amount_usd"), "amount_usd"))
        row = await asyncio.to_thread(po.request_payout, request.app.state.ledger.engine, who.account_id, rail, amount,
                                      request.app.state.payout_rules)
        return json_response(po.payout_view(row), 202)

    @get("/", guards=[requires_owner_or_admin], summary="The owner's payouts, newest first")
    async def list_payouts(self, request: Request, who: Caller, account_id: QueryId = None) -> Response:
        rows = await read(request, po.list_payouts, accounts.scoped_account(who, account_id))
        return json_response({"data": [po.payout_view(row) for row in rows]})

    @get("/destinations", guards=[requires_owner_or_admin], summary="Where the owner is paid on each rail")
    async def list_destinations(self, request: Request, who: Caller, account_id: QueryId = None) -> Response:
        found = await read(request, po.list_destinations, accounts.scoped_account(who, account_id))
        return json_response({"data": [d.as_dict(utc_now()) for d in found]})

    @put("/destination", guards=[requires_owner],
         summary="Set where a rail pays the owner; a change takes effect after a 24-hour cooldown and is mailed")
    async def set_destination(self, request: Request, who: Caller) -> Response:
        """Body: {"rail": "usdc", "destination": "0x…"} or {"rail": "stripe", "destination": "acct_…"};
        optional "weekly": true pays out every Monday whatever exceeds the minimum."""
        body = await json_object(request)
        rail, destination = _text_field(body, "rail", "usdc"), _text_field(body, "destination", "0x…")
        weekly = body.get("weekly")
        if weekly is not None and not isinstance(weekly, bool):
            raise InvalidRequest("weekly is true or false", param="weekly")
        engine = request.app.state.ledger.engine
        found, changed = await asyncio.to_thread(po.save_destination, engine, who.account_id, rail, destination, weekly)
        if changed:
            await asyncio.to_thread(outbox.dispatch, engine, send_task)  # the mail to the owner's people
        return json_response({**found.as_dict(utc_now()), "changed": changed})

    @get("/{name:str}", guards=[requires_owner_or_admin],
         summary="One payout (its state, reference and confirmations), or its receipt as PDF/A-3b with .pdf")
    async def get_payout(self, request: Request, who: Caller, name: PathName) -> Response:
        payout_id = _payout_id(name)
        owner = None if who.is_admin else who.account_id
        row = await read(request, po.get_payout, payout_id, owner)
        if not name.endswith(PDF_SUFFIX):
            return json_response(po.payout_view(row))
        pdf = await asyncio.to_thread(payout_receipts.receipt_pdf, request.app.state.ledger.engine,
                                      request.app.state.invoices, row["id"])
        return Response(pdf, media_type="application/pdf",
                        headers={"content-disposition": f'attachment; filename="payout-{payout_id}.pdf"'})


def _payout_id(name: str) -> int:
    digits = name.removesuffix(PDF_SUFFIX)
    if not digits.isdigit() or not 0 < int(digits) <= INT64_MAX:
        raise po.UnknownPayout(f"no payout {name}")
    return int(digits)
