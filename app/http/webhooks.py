"""Webhooks from payment providers: verify, store, answer 2xx at once, then
process once (in-process here; on a task queue in production)."""
from __future__ import annotations

import asyncio
import logging

from litestar import Request, Response, post

from app.http.plumbing import json_response
from app import outbox
from app.jobs.celery import send_task
from app.payments import stripe as stripe_payments
from ledger.errors import LedgerError

log = logging.getLogger(__name__)


@post("/webhooks/stripe", summary="Stripe events (verified with the endpoint secret)", status_code=200)
async def stripe_webhook(request: Request) -> Response:
    payload = await request.body()
    engine, settings = request.app.state.ledger.engine, request.app.state.stripe
    try:
        event_id = await asyncio.to_thread(stripe_payments.receive_webhook, engine, settings,
                                           payload, request.headers.get("stripe-signature"))
    except LedgerError as exc:
        return json_response({"error": {"message": str(exc), "type": "invalid_request_error", "param": None, "code": exc.code}}, 400)
    if event_id is not None:
        task = asyncio.create_task(_process(engine, settings, event_id))
        request.app.state.background.add(task)
        task.add_done_callback(request.app.state.background.discard)
    return json_response({"received": True}, 200)


async def _process(engine, settings, event_id: str) -> None:
    try:  # an event that fails is parked by process_event; what reaches here is the database failing
        outcome = await asyncio.to_thread(stripe_payments.process_event, engine, settings, event_id)
        await asyncio.to_thread(outbox.dispatch, engine, send_task)  # invoices and credit notes of what it committed
        log.info("stripe event %s: %s", event_id, outcome)
    except Exception:  # stored and unprocessed: `paralon stripe process-pending` picks it up
        log.exception("stripe event %s failed", event_id)
