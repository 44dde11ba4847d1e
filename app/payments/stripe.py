"""Card top-ups through Stripe Checkout, at the edge of the system.

A checkout session is created for the caller's own account (the account in
`client_reference_id` and metadata, a deterministic idempotency key, the API
version pinned). A webhook is verified with Stripe's signature scheme, stored
raw and unique on its event id before it is answered, and processed once: a
paid session that this service created credits its `amount_total`, keyed by
the session, so any number of copies and both "completed" and
"async_payment_succeeded" credit it once.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import orjson
import stripe
from sqlalchemy import Engine, select, update
from sqlalchemy.exc import IntegrityError

from app import outbox
from app.limits import (
    CHECKOUT_IDEMPOTENCY_DIGEST_CHARS,
    STRIPE_NETWORK_RETRIES_MAX,
    STRIPE_OUTCOME_CHARS_MAX,
    STRIPE_SIGNATURE_TOLERANCE_S,
)
from app.payments.schema import stripe_checkout_sessions, stripe_disputes, stripe_events
from ledger import commands as cmd
from ledger.errors import InvalidAmount, InvalidInput, LedgerError
from ledger.money import CENT_DECIMALS, CENTS_PER_USD, NANO_USD_PER_CENT, usd_to_nano_usd
from ledger.schema import utc_now
from ledger.store import append_one

STRIPE_API_VERSION = "2026-10-28.endive"  # pinned: the shapes this module reads
STRIPE_COUNTER_ACCOUNT = "external:stripe"
DISPUTED_ACCOUNT = "external:stripe:disputed"
PAID_SESSION_EVENTS = ("checkout.session.completed", "checkout.session.async_payment_succeeded")


class StripeNotConfigured(InvalidInput):
    code = "stripe_not_configured"


class BadSignature(InvalidInput):
    code = "bad_signature"


@dataclass(frozen=True)
class StripeSettings:
    secret_key: str | None = field(repr=False)  # secrets stay out of reprs and logs
    webhook_secret: str | None = field(repr=False)
    api_base: str | None
    checkout_min_cents: int
    checkout_max_cents: int
    success_url: str
    cancel_url: str


def amount_cents(amount_usd: object, settings: StripeSettings) -> int:
    """'25.00' -> 2500: at most two decimals, within the configured limits."""
    try:
        cents = usd_to_nano_usd(amount_usd, decimals_max=CENT_DECIMALS) // NANO_USD_PER_CENT
    except InvalidAmount as exc:
        raise InvalidAmount(f"amount_usd must be a decimal amount with at most two decimals such as \"25.00\": {exc}") from None
    if not settings.checkout_min_cents <= cents <= settings.checkout_max_cents:
        raise InvalidAmount(f"amount_usd must be from {settings.checkout_min_cents / CENTS_PER_USD:.2f} to {settings.checkout_max_cents / CENTS_PER_USD:.2f}")
    return cents


def _client(settings: StripeSettings) -> stripe.StripeClient:
    if not settings.secret_key:
        raise StripeNotConfigured("card top-ups need PARALON_STRIPE_SECRET_KEY")
    addresses = {"api": settings.api_base} if settings.api_base else None
    return stripe.StripeClient(settings.secret_key, stripe_version=STRIPE_API_VERSION, base_addresses=addresses,
                               max_network_retries=STRIPE_NETWORK_RETRIES_MAX)


def checkout_idempotency_key(account_id: int, cents: int, caller_key: str) -> str:
    """The same account, amount and caller key always make the same session."""
    return "paralon-checkout-" + hashlib.sha256(f"{account_id}:{cents}:{caller_key}".encode()).hexdigest()[:CHECKOUT_IDEMPOTENCY_DIGEST_CHARS]


def create_checkout(engine: Engine, settings: StripeSettings, account_id: int, amount_usd: object, caller_key: str) -> dict:
    cents = amount_cents(amount_usd, settings)
    session = _client(settings).v1.checkout.sessions.create(
        params={
            "mode": "payment",
            "client_reference_id": str(account_id),
            "metadata": {"paralon_account_id": str(account_id)},
            "line_items": [{"quantity": 1, "price_data": {"currency": "usd", "unit_amount": cents,
                                                          "product_data": {"name": "Paralon credits"}}}],
            "success_url": settings.success_url,
            "cancel_url": settings.cancel_url,
        },
        options={"idempotency_key": checkout_idempotency_key(account_id, cents, caller_key)},
    )
    with engine.begin() as conn:
        if conn.execute(select(stripe_checkout_sessions.c.session_id).where(stripe_checkout_sessions.c.session_id == session.id)).first() is None:
            conn.execute(stripe_checkout_sessions.insert().values(session_id=session.id, account_id=account_id,
                                                                  amount_cents=cents, created_at=utc_now()))
    return {"id": session.id, "url": session.url, "amount_cents": cents}


def receive_webhook(engine: Engine, settings: StripeSettings, payload: bytes, signature_header: str | None) -> str | None:
    """Verify and store one webhook; returns the event id when it is new (to be
    processed), None when it was already stored. A bad signature stores nothing."""
    if not settings.webhook_secret:
        raise StripeNotConfigured("webhooks need PARALON_STRIPE_WEBHOOK_SECRET")
    try:
        stripe.WebhookSignature.verify_header(payload.decode("utf-8", "replace"), signature_header, settings.webhook_secret,
                                              tolerance=STRIPE_SIGNATURE_TOLERANCE_S)
    except stripe.SignatureVerificationError as exc:
        raise BadSignature(f"webhook signature refused: {exc}") from None
    try:
        event = orjson.loads(payload)
        event_id, event_type = event["id"], event["type"]
    except (ValueError, KeyError, TypeError):
        raise InvalidInput("webhook body is not a Stripe event") from None
    try:
        with engine.begin() as conn:
            conn.execute(stripe_events.insert().values(event_id=event_id, event_type=event_type,
                                                       payload=payload.decode(), received_at=utc_now()))
    except IntegrityError:
        return None  # a copy of an event already stored
    return event_id


WAITING = "waiting"


def process_event(engine: Engine, event_id: str) -> str:
    """Act on a stored event once; returns what was done. Safe to run again:
    every ledger effect carries an idempotency key derived from Stripe's ids,
    and is appended in the transaction that records it on the session row.
    An event that needs something not yet seen (a refund before its payment)
    stays pending, and is processed again after the next credit. The invoices
    and credit notes it writes to the outbox are sent by the caller, after this
    returns (`app.outbox.dispatch`)."""
    with engine.connect() as conn:
        row = conn.execute(select(stripe_events).where(stripe_events.c.event_id == event_id)).one()
    event = orjson.loads(row.payload)
    outcome = _apply(engine, event)
    with engine.begin() as conn:
        values = {"outcome": outcome[:STRIPE_OUTCOME_CHARS_MAX]}
        if not outcome.startswith(WAITING):
            values["processed_at"] = utc_now()
        conn.execute(update(stripe_events).where(stripe_events.c.event_id == event_id).values(**values))
    if outcome.startswith("credited"):
        process_pending(engine, waiting_only=True)
    return outcome


def _apply(engine: Engine, event: dict) -> str:
    try:
        return _dispatch(engine, event)
    except LedgerError as exc:  # e.g. the account is not a customer: recorded, never retried into a loop
        return f"refused: {exc}"


def _dispatch(engine: Engine, event: dict) -> str:
    obj = event["data"]["object"]
    if event["type"] in PAID_SESSION_EVENTS:
        if event["type"] == "checkout.session.completed" and obj.get("payment_status") != "paid":
            return "ignored: session completed, payment not yet paid"
        return _credit_session(engine, event["id"], obj)
    if event["type"] == "charge.refunded":
        return _refund_charge(engine, event["id"], obj)
    if event["type"] in ("charge.dispute.created", "charge.dispute.closed"):
        return _dispute(engine, obj, closed=event["type"] == "charge.dispute.closed")
    return f"ignored: {event['type']}"


def _locked_session(conn, *where):
    return conn.execute(select(stripe_checkout_sessions).where(*where).with_for_update()).first()


def _credit_session(engine: Engine, event_id: str, session: dict) -> str:
    amount_total = session.get("amount_total")
    if type(amount_total) is not int or amount_total <= 0:
        return f"refused: session {session.get('id')} has no positive amount_total"
    with engine.begin() as conn:
        ours = _locked_session(conn, stripe_checkout_sessions.c.session_id == session.get("id"))
        if ours is None:
            return f"ignored: session {session.get('id')} was not created by this service"
        if ours.credited_cents:
            return f"already credited: session {ours.session_id}"
        result = append_one(conn, cmd.PurchaseCredits(
            ours.account_id, amount_total * NANO_USD_PER_CENT, "card", f"stripe:session:{ours.session_id}:event:{event_id}",
            STRIPE_COUNTER_ACCOUNT, f"stripe:checkout:{ours.session_id}",
        ))
        conn.execute(update(stripe_checkout_sessions).where(stripe_checkout_sessions.c.session_id == ours.session_id)
                     .values(credited_cents=amount_total, payment_intent=session.get("payment_intent"), credit_seq=result.seq))
        outbox.add(conn, "paralon.issue_invoice", result.seq)
    return f"credited {amount_total} cents to account {ours.account_id} (event {result.seq})"


def _refund_charge(engine: Engine, event_id: str, charge: dict) -> str:
    """Refund what is newly refunded: Stripe's `amount_refunded` is cumulative,
    so copies and late arrivals of earlier refunds change nothing."""
    refunded_total = charge.get("amount_refunded")
    if type(refunded_total) is not int or refunded_total < 0:
        return "refused: charge without amount_refunded"
    with engine.begin() as conn:
        ours = _locked_session(conn, stripe_checkout_sessions.c.payment_intent == charge.get("payment_intent"))
        if ours is None or not ours.credited_cents:
            return f"{WAITING}: no credited session for payment {charge.get('payment_intent')} yet"
        refunded_total = min(refunded_total, ours.credited_cents)
        newly_cents = refunded_total - ours.refunded_cents
        if newly_cents <= 0:
            return f"nothing new: {ours.refunded_cents} cents of charge {charge.get('id')} already refunded"
        result = append_one(conn, cmd.RefundCredits(
            ours.account_id, newly_cents * NANO_USD_PER_CENT, "card", f"stripe:charge:{charge.get('id')}:event:{event_id}",
            STRIPE_COUNTER_ACCOUNT, f"stripe:refund:{charge.get('id')}:{refunded_total}",
        ))
        conn.execute(update(stripe_checkout_sessions).where(stripe_checkout_sessions.c.session_id == ours.session_id)
                     .values(refunded_cents=refunded_total))
        outbox.add(conn, "paralon.issue_credit_note", result.seq, ours.credit_seq)
    return f"refunded {newly_cents} cents from account {ours.account_id} (event {result.seq})"


def _dispute(engine: Engine, dispute: dict, *, closed: bool) -> str:
    """Created: freeze the disputed amount. Closed as won: reverse the freeze;
    lost: the frozen amount goes back to the payer. A close that arrives first
    freezes and resolves in one go; whatever arrives later changes nothing."""
    status, amount, dispute_id = dispute.get("status"), dispute.get("amount"), dispute.get("id")
    if closed and status not in ("won", "lost"):
        return f"ignored: dispute {dispute_id} closed as {status}"
    if type(amount) is not int or amount <= 0 or not dispute_id:
        return "refused: dispute without a positive amount"
    with engine.begin() as conn:
        ours = _locked_session(conn, stripe_checkout_sessions.c.payment_intent == dispute.get("payment_intent"))
        if ours is None or not ours.credited_cents:
            return f"{WAITING}: no credited session for payment {dispute.get('payment_intent')} yet"
        row = conn.execute(select(stripe_disputes).where(stripe_disputes.c.dispute_id == dispute_id).with_for_update()).first()
        if row is None:
            frozen_cents = min(amount, ours.credited_cents)
            freeze = append_one(conn, cmd.FreezeCredits(ours.account_id, frozen_cents * NANO_USD_PER_CENT, f"stripe:dispute:{dispute_id}",
                                                        DISPUTED_ACCOUNT, f"stripe:dispute:{dispute_id}:freeze"))
            conn.execute(stripe_disputes.insert().values(dispute_id=dispute_id, session_id=ours.session_id,
                                                         amount_cents=frozen_cents, freeze_seq=freeze.seq, status="frozen"))
            row = conn.execute(select(stripe_disputes).where(stripe_disputes.c.dispute_id == dispute_id)).one()
        if not closed:
            return f"frozen {row.amount_cents} cents of account {ours.account_id} for dispute {dispute_id}"
        if row.status != "frozen":
            return f"nothing new: dispute {dispute_id} already closed as {row.status}"
        if status == "won":
            append_one(conn, cmd.ReverseEvent(row.freeze_seq, f"dispute {dispute_id} won", f"stripe:dispute:{dispute_id}:won"))
        else:
            forfeited = append_one(conn, cmd.ForfeitFrozenCredits(
                ours.account_id, row.amount_cents * NANO_USD_PER_CENT, f"stripe:dispute:{dispute_id}",
                DISPUTED_ACCOUNT, STRIPE_COUNTER_ACCOUNT, f"stripe:dispute:{dispute_id}:lost"))
            outbox.add(conn, "paralon.issue_credit_note", forfeited.seq, ours.credit_seq)
        conn.execute(update(stripe_disputes).where(stripe_disputes.c.dispute_id == dispute_id).values(status=status))
    return f"dispute {dispute_id} {status}: {row.amount_cents} cents"


def process_pending(engine: Engine, *, waiting_only: bool = False) -> list[tuple[str, str]]:
    """Every stored event not processed yet (the process stopped between
    answering and processing, or the event waits for another), oldest first;
    returns (event id, outcome)."""
    query = select(stripe_events.c.event_id).where(stripe_events.c.processed_at.is_(None))
    if waiting_only:
        query = query.where(stripe_events.c.outcome.like(f"{WAITING}%"))
    with engine.connect() as conn:
        pending = conn.execute(query.order_by(stripe_events.c.received_at, stripe_events.c.event_id)).scalars().all()
    return [(event_id, process_event(engine, event_id)) for event_id in pending]
