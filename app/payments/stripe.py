"""Card top-ups through Stripe Checkout, at the edge of the system.

A checkout session is created for the caller's own account (the account in
`client_reference_id` and metadata, a deterministic idempotency key, the API
version pinned). A webhook is verified with Stripe's signature scheme, stored
raw and unique on its event id before it is answered, and processed once: a
paid session that this service created credits the amount it was created for,
once Stripe's API confirms the session paid for that amount and currency,
keyed by the session, so any number of copies and both "completed" and
"async_payment_succeeded" credit it once. The refunds and disputes of a
charge never take more than it credited. Transfer events (owners' payouts)
are stored and parked the same way and processed by
app/payments/payout_stripe.py. An event that cannot be processed (a
malformed shape, an unconfirmed payment, Stripe unreachable) is parked with
its error and tried again with backoff, without holding up the others.
"""
from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

import orjson
import stripe
from sqlalchemy import Engine, func, or_, select, update
from sqlalchemy.exc import IntegrityError

from app import outbox
from app.limits import (
    CHECKOUT_IDEMPOTENCY_DIGEST_CHARS,
    STRIPE_ERROR_CHARS_MAX,
    STRIPE_EVENT_ATTEMPTS_MAX,
    STRIPE_FIELD_SHOWN_CHARS_MAX,
    STRIPE_OUTCOME_CHARS_MAX,
    STRIPE_RETRY_BACKOFF_FACTOR,
    STRIPE_RETRY_BACKOFF_S_BASE,
    STRIPE_RETRY_BACKOFF_S_MAX,
    STRIPE_SIGNATURE_TOLERANCE_S,
)
from app.payments import payout_stripe
from app.payments.schema import stripe_checkout_sessions, stripe_disputes, stripe_events
from app.payments.stripe_client import NotConfirmed, StripeNotConfigured, StripeSettings, client
from app.payments.stripe_shapes import DISPUTE_EVENTS, PAID_SESSION_EVENTS, TRANSFER_EVENTS, envelope, event_object
from ledger import commands as cmd
from ledger.errors import InvalidAmount, InvalidInput, LedgerError
from ledger.money import CENT_DECIMALS, CENTS_PER_USD, NANO_USD_PER_CENT, usd_to_nano_usd
from ledger.schema import utc_now
from ledger.store import append_one

STRIPE_COUNTER_ACCOUNT = "external:stripe"
DISPUTED_ACCOUNT = "external:stripe:disputed"
CHECKOUT_CURRENCY = "usd"  # every session this service creates
# How a closed dispute ends for the frozen credits: lost goes back to the payer;
# won, an inquiry closed without a chargeback, or a prevented one, releases them.
DISPUTE_LOST = "lost"
DISPUTE_RELEASED = ("won", "warning_closed", "prevented")
TAKING_DISPUTE_STATUSES = ("frozen", DISPUTE_LOST)  # what a charge's disputes hold or took


class BadSignature(InvalidInput):
    code = "bad_signature"


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
    return client(settings, "card top-ups")


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
            "line_items": [{"quantity": 1, "price_data": {"currency": CHECKOUT_CURRENCY, "unit_amount": cents,
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
    processed), None when it was already stored. A bad signature, or an id or
    type that is not a string within its column, stores nothing."""
    if not settings.webhook_secret:
        raise StripeNotConfigured("webhooks need PARALON_STRIPE_WEBHOOK_SECRET")
    try:
        stripe.WebhookSignature.verify_header(payload.decode("utf-8", "replace"), signature_header, settings.webhook_secret,
                                              tolerance=STRIPE_SIGNATURE_TOLERANCE_S)
    except stripe.SignatureVerificationError as exc:
        raise BadSignature(f"webhook signature refused: {exc}") from None
    event_id, event_type = envelope(payload)
    try:
        with engine.begin() as conn:
            conn.execute(stripe_events.insert().values(event_id=event_id, event_type=event_type,
                                                       payload=payload.decode(), received_at=utc_now()))
    except IntegrityError:
        return None  # a copy of an event already stored
    return event_id


WAITING = "waiting"
PARKED = "parked"


def process_event(engine: Engine, settings: StripeSettings, event_id: str, *, now: datetime | None = None) -> str:
    """Act on a stored event once; returns what was done. Safe to run again:
    every ledger effect carries an idempotency key derived from Stripe's ids,
    and is appended in the transaction that records it on the session row.
    An event that needs something not yet seen (a refund before its payment)
    stays pending, and is processed again after the next credit. An event that
    fails is parked with its error (nothing it did is committed). The invoices
    and credit notes it writes to the outbox are sent by the caller, after this
    returns (`app.outbox.dispatch`)."""
    with engine.connect() as conn:
        row = conn.execute(select(stripe_events).where(stripe_events.c.event_id == event_id)).one()
    try:
        event = orjson.loads(row.payload)
        outcome = _apply(engine, settings, event, event_object(event))
    except Exception as exc:  # whatever it is, this event must not hold up the others
        return _park(engine, row, f"{type(exc).__name__}: {exc}", now or utc_now())
    with engine.begin() as conn:
        values = {"outcome": outcome[:STRIPE_OUTCOME_CHARS_MAX], "parked_at": None, "next_attempt_at": None}
        if not outcome.startswith(WAITING):
            values["processed_at"] = utc_now()
        conn.execute(update(stripe_events).where(stripe_events.c.event_id == event_id).values(**values))
    if outcome.startswith("credited"):
        process_pending(engine, settings, waiting_only=True)
    return outcome


def retry_delay_s(attempts: int) -> int:
    """After the first failure the base delay, growing by the factor with each failure after it, up to the limit."""
    return min(STRIPE_RETRY_BACKOFF_S_BASE * STRIPE_RETRY_BACKOFF_FACTOR ** (attempts - 1), STRIPE_RETRY_BACKOFF_S_MAX)


def _park(engine: Engine, row, error: str, now: datetime) -> str:
    attempts = row.attempts + 1
    due = now + timedelta(seconds=retry_delay_s(attempts)) if attempts < STRIPE_EVENT_ATTEMPTS_MAX else None
    outcome = f"{PARKED} after attempt {attempts}: {error}"
    with engine.begin() as conn:
        conn.execute(update(stripe_events).where(stripe_events.c.event_id == row.event_id).values(
            attempts=attempts, parked_at=now, next_attempt_at=due, last_error=error[:STRIPE_ERROR_CHARS_MAX],
            outcome=outcome[:STRIPE_OUTCOME_CHARS_MAX]))
    return outcome


def _apply(engine: Engine, settings: StripeSettings, event: dict, obj: dict) -> str:
    try:
        return _dispatch(engine, settings, event, obj)
    except LedgerError as exc:  # e.g. the account is not a customer: recorded, never retried into a loop
        return f"refused: {exc}"


def _dispatch(engine: Engine, settings: StripeSettings, event: dict, obj: dict) -> str:
    if event["type"] in PAID_SESSION_EVENTS:
        if event["type"] == "checkout.session.completed" and obj.get("payment_status") != "paid":
            return "ignored: session completed, payment not yet paid"
        return _credit_session(engine, settings, event["id"], obj)
    if event["type"] == "charge.refunded":
        return _refund_charge(engine, event["id"], obj)
    if event["type"] in DISPUTE_EVENTS:
        return _dispute(engine, obj, closed=event["type"] == "charge.dispute.closed")
    if event["type"] in TRANSFER_EVENTS:  # an owner's payout taken back
        return payout_stripe.on_transfer_event(engine, settings, obj)
    return f"ignored: {event['type']}"


def _locked_session(conn, *where):
    return conn.execute(select(stripe_checkout_sessions).where(*where).with_for_update()).first()


def _confirmed_session(settings: StripeSettings, ours) -> dict:
    """Stripe's own record of the session, as Stripe recommends before fulfilling:
    paid, for the amount and currency this service created it for."""
    try:
        confirmed = _client(settings).v1.checkout.sessions.retrieve(ours.session_id).to_dict()
    except (StripeNotConfigured, stripe.StripeError) as exc:
        raise NotConfirmed(f"cannot retrieve session {ours.session_id} from Stripe: {exc}") from None
    expected = {"id": ours.session_id, "payment_status": "paid", "amount_total": ours.amount_cents, "currency": CHECKOUT_CURRENCY}
    wrong = [f"{name} {confirmed.get(name)!r} (expected {value!r})" for name, value in expected.items() if confirmed.get(name) != value]
    if wrong:
        raise NotConfirmed(f"Stripe's session {ours.session_id} does not confirm the credit: " + ", ".join(wrong))
    return confirmed


def _credit_session(engine: Engine, settings: StripeSettings, event_id: str, session: dict) -> str:
    """Credit what the session was created for; the event's own amount is not taken on trust."""
    with engine.connect() as conn:
        ours = conn.execute(select(stripe_checkout_sessions).where(stripe_checkout_sessions.c.session_id == session["id"])).first()
    if ours is None:
        return f"ignored: session {session['id']} was not created by this service"
    if ours.credited_cents:
        return f"already credited: session {ours.session_id}"
    confirmed = _confirmed_session(settings, ours)
    with engine.begin() as conn:
        ours = _locked_session(conn, stripe_checkout_sessions.c.session_id == ours.session_id)
        if ours.credited_cents:
            return f"already credited: session {ours.session_id}"
        result = append_one(conn, cmd.PurchaseCredits(
            ours.account_id, ours.amount_cents * NANO_USD_PER_CENT, "card", f"stripe:session:{ours.session_id}:event:{event_id}",
            STRIPE_COUNTER_ACCOUNT, f"stripe:checkout:{ours.session_id}",
        ))
        conn.execute(update(stripe_checkout_sessions).where(stripe_checkout_sessions.c.session_id == ours.session_id)
                     .values(credited_cents=ours.amount_cents, payment_intent=confirmed.get("payment_intent"), credit_seq=result.seq))
        outbox.add(conn, "paralon.issue_invoice", result.seq)
    return f"credited {ours.amount_cents} cents to account {ours.account_id} (event {result.seq})"


def _room_cents(conn, ours) -> int:
    """What the charge's refunds and disputes may still take: the credit, less what
    refunds took and what disputes hold frozen or took (a released dispute gave it back)."""
    disputed = conn.execute(select(func.coalesce(func.sum(stripe_disputes.c.amount_cents), 0)).where(
        stripe_disputes.c.session_id == ours.session_id, stripe_disputes.c.status.in_(TAKING_DISPUTE_STATUSES))).scalar_one()
    return ours.credited_cents - ours.refunded_cents - int(disputed)  # PostgreSQL sums BIGINT as NUMERIC (a Decimal)


def _refund_charge(engine: Engine, event_id: str, charge: dict) -> str:
    """Refund what is newly refunded: Stripe's `amount_refunded` is cumulative,
    so copies and late arrivals of earlier refunds change nothing; and no more
    than the charge's room, so a refund of money a dispute already holds takes nothing."""
    with engine.begin() as conn:
        ours = _locked_session(conn, stripe_checkout_sessions.c.payment_intent == charge["payment_intent"])
        if ours is None or not ours.credited_cents:
            return f"{WAITING}: no credited session for payment {charge['payment_intent']} yet"
        newly_cents = min(min(charge["amount_refunded"], ours.credited_cents) - ours.refunded_cents, _room_cents(conn, ours))
        if newly_cents <= 0:
            return f"nothing new: charge {charge['id']} has {ours.refunded_cents} cents refunded, {_room_cents(conn, ours)} cents left to take"
        refunded_total = ours.refunded_cents + newly_cents
        result = append_one(conn, cmd.RefundCredits(
            ours.account_id, newly_cents * NANO_USD_PER_CENT, "card", f"stripe:charge:{charge['id']}:event:{event_id}",
            STRIPE_COUNTER_ACCOUNT, f"stripe:refund:{charge['id']}:{refunded_total}",
        ))
        conn.execute(update(stripe_checkout_sessions).where(stripe_checkout_sessions.c.session_id == ours.session_id)
                     .values(refunded_cents=refunded_total))
        outbox.add(conn, "paralon.issue_credit_note", result.seq, ours.credit_seq)
    return f"refunded {newly_cents} cents from account {ours.account_id} (event {result.seq})"


def _dispute(engine: Engine, dispute: dict, *, closed: bool) -> str:
    """Created: freeze the disputed amount, within the charge's room. Closed as
    lost: the frozen amount goes back to the payer; otherwise (won, ...) the freeze
    is reversed. A close that arrives first freezes and resolves in one go;
    whatever arrives later changes nothing."""
    status, dispute_id = dispute.get("status"), dispute["id"]
    if closed and status not in (DISPUTE_LOST, *DISPUTE_RELEASED):
        return f"ignored: dispute {dispute_id} closed as {status}"
    with engine.begin() as conn:
        ours = _locked_session(conn, stripe_checkout_sessions.c.payment_intent == dispute["payment_intent"])
        if ours is None or not ours.credited_cents:
            return f"{WAITING}: no credited session for payment {dispute['payment_intent']} yet"
        row = conn.execute(select(stripe_disputes).where(stripe_disputes.c.dispute_id == dispute_id).with_for_update()).first()
        if row is None:
            frozen_cents = min(dispute["amount"], _room_cents(conn, ours))
            if frozen_cents <= 0:
                return f"nothing to freeze: the charge of dispute {dispute_id} is already refunded or disputed in full"
            row = _freeze(conn, ours, dispute_id, frozen_cents)
        if not closed:
            return f"frozen {row.amount_cents} cents of account {ours.account_id} for dispute {dispute_id}"
        if row.status != "frozen":
            return f"nothing new: dispute {dispute_id} already closed as {row.status}"
        _close(conn, ours, row, status)
    return f"dispute {dispute_id} {status}: {row.amount_cents} cents"


def _freeze(conn, ours, dispute_id: str, frozen_cents: int):
    freeze = append_one(conn, cmd.FreezeCredits(ours.account_id, frozen_cents * NANO_USD_PER_CENT, f"stripe:dispute:{dispute_id}",
                                                DISPUTED_ACCOUNT, f"stripe:dispute:{dispute_id}:freeze"))
    conn.execute(stripe_disputes.insert().values(dispute_id=dispute_id, session_id=ours.session_id,
                                                 amount_cents=frozen_cents, freeze_seq=freeze.seq, status="frozen"))
    return conn.execute(select(stripe_disputes).where(stripe_disputes.c.dispute_id == dispute_id)).one()


def _close(conn, ours, row, status: str) -> None:
    if status == DISPUTE_LOST:
        forfeited = append_one(conn, cmd.ForfeitFrozenCredits(
            ours.account_id, row.amount_cents * NANO_USD_PER_CENT, f"stripe:dispute:{row.dispute_id}",
            DISPUTED_ACCOUNT, STRIPE_COUNTER_ACCOUNT, f"stripe:dispute:{row.dispute_id}:lost"))
        outbox.add(conn, "paralon.issue_credit_note", forfeited.seq, ours.credit_seq)
    else:
        append_one(conn, cmd.ReverseEvent(row.freeze_seq, f"dispute {row.dispute_id} {status}", f"stripe:dispute:{row.dispute_id}:won"))
    conn.execute(update(stripe_disputes).where(stripe_disputes.c.dispute_id == row.dispute_id).values(status=status))


def process_pending(engine: Engine, settings: StripeSettings, *, waiting_only: bool = False, parked_only: bool = False,
                    now: datetime | None = None) -> list[tuple[str, str]]:
    """Every stored event not processed yet (the process stopped between
    answering and processing, the event waits for another, or it is parked and
    its next attempt is due), oldest first; returns (event id, outcome).
    `parked_only`: only parked events now due (the beat's retries, which leave
    fresh events to the webhook route that stored them)."""
    now = now or utc_now()
    query = select(stripe_events.c.event_id).where(stripe_events.c.processed_at.is_(None))
    if waiting_only:
        query = query.where(stripe_events.c.outcome.like(f"{WAITING}%"), stripe_events.c.parked_at.is_(None))
    elif parked_only:
        query = query.where(stripe_events.c.parked_at.is_not(None), stripe_events.c.next_attempt_at <= now)
    else:
        query = query.where(or_(stripe_events.c.parked_at.is_(None), stripe_events.c.next_attempt_at <= now))
    with engine.connect() as conn:
        pending = conn.execute(query.order_by(stripe_events.c.received_at, stripe_events.c.event_id)).scalars().all()
    return [(event_id, process_event(engine, settings, event_id, now=now)) for event_id in pending]


def _status(row) -> str:
    return "processed" if row.processed_at else PARKED if row.parked_at else WAITING


def _described(row) -> dict:
    return {"event_id": row.event_id, "event_type": row.event_type, "status": _status(row), "attempts": row.attempts,
            "outcome": row.outcome, "last_error": row.last_error, "received_at": row.received_at,
            "parked_at": row.parked_at, "next_attempt_at": row.next_attempt_at}


def parked_events(engine: Engine) -> list[dict]:
    """Events that failed and are not processed: being retried (next_attempt_at) or waiting for an operator."""
    with engine.connect() as conn:
        rows = conn.execute(select(stripe_events).where(stripe_events.c.processed_at.is_(None), stripe_events.c.parked_at.is_not(None))
                            .order_by(stripe_events.c.received_at, stripe_events.c.event_id)).all()
    return [_described(row) for row in rows]


def parked_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(stripe_events).where(
            stripe_events.c.processed_at.is_(None), stripe_events.c.parked_at.is_not(None))).scalar_one()


def replay(engine: Engine, settings: StripeSettings, event_id: str) -> dict:
    """An operator's attempt at one stored, unprocessed event now, whatever its backoff or attempts."""
    with engine.connect() as conn:
        row = conn.execute(select(stripe_events.c.processed_at, stripe_events.c.outcome).where(stripe_events.c.event_id == event_id)).first()
    if row is None:
        raise InvalidInput(f"no Stripe event {event_id[:STRIPE_FIELD_SHOWN_CHARS_MAX]!r} is stored")
    if row.processed_at is not None:
        raise InvalidInput(f"Stripe event {event_id} was already processed: {row.outcome}")
    process_event(engine, settings, event_id)
    with engine.connect() as conn:
        return _described(conn.execute(select(stripe_events).where(stripe_events.c.event_id == event_id)).one())
