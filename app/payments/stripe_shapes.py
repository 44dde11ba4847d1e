"""The shapes of the Stripe events Paralon reads, checked before anything is
written or processed: the envelope (id, type) when a webhook is received, the
type's own fields of `data.object` when it is processed. Each error names the
field, so the parked record says what was wrong."""
from __future__ import annotations

import orjson

from app.limits import STRIPE_EVENT_TYPE_CHARS_MAX, STRIPE_FIELD_SHOWN_CHARS_MAX, STRIPE_ID_CHARS_MAX
from ledger.errors import InvalidInput

PAID_SESSION_EVENTS = ("checkout.session.completed", "checkout.session.async_payment_succeeded")
DISPUTE_EVENTS = ("charge.dispute.created", "charge.dispute.closed")
# A transfer to a connected account (an owner's payout) reversed; `transfer.updated`
# too, since either says Stripe's record changed and Stripe's record decides.
TRANSFER_EVENTS = ("transfer.reversed", "transfer.updated")


class MalformedEvent(InvalidInput):
    code = "malformed_stripe_event"


def _shown(value: object) -> str:
    return repr(value)[:STRIPE_FIELD_SHOWN_CHARS_MAX]


def _text(where: dict, name: str, chars_max: int, path: str) -> str:
    value = where.get(name)
    if type(value) is not str or not 0 < len(value) <= chars_max:
        raise MalformedEvent(f"{path}{name} must be a string of 1 to {chars_max} characters, got {_shown(value)}")
    return value


def _cents(where: dict, name: str, minimum: int, path: str) -> int:
    value = where.get(name)
    if type(value) is not int or value < minimum:  # bool is not int here, nor "700"
        raise MalformedEvent(f"{path}{name} must be a whole number of cents of at least {minimum}, got {_shown(value)}")
    return value


def envelope(payload: bytes) -> tuple[str, str]:
    """The event's id and type, as the events table stores them."""
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise MalformedEvent("webhook body is not JSON") from None
    if not isinstance(event, dict):
        raise MalformedEvent("webhook body is not a Stripe event (a JSON object)")
    return _text(event, "id", STRIPE_ID_CHARS_MAX, "event."), _text(event, "type", STRIPE_EVENT_TYPE_CHARS_MAX, "event.")


def event_object(event: dict) -> dict:
    """`data.object` of an event this service acts on, with the fields its type
    needs; an event of another type is returned as it is (it is ignored)."""
    kind = event.get("type")
    if kind not in (*PAID_SESSION_EVENTS, "charge.refunded", *DISPUTE_EVENTS, *TRANSFER_EVENTS):
        return {}
    data = event.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    if not isinstance(obj, dict):
        raise MalformedEvent(f"{kind}: data.object must be an object, got {_shown(obj)}")
    path = f"{kind}: data.object."
    _text(obj, "id", STRIPE_ID_CHARS_MAX, path)
    if kind == "charge.refunded":
        _text(obj, "payment_intent", STRIPE_ID_CHARS_MAX, path)
        _cents(obj, "amount_refunded", 0, path)
    elif kind in DISPUTE_EVENTS:
        _text(obj, "payment_intent", STRIPE_ID_CHARS_MAX, path)
        _cents(obj, "amount", 1, path)
        if kind == "charge.dispute.closed":
            _text(obj, "status", STRIPE_EVENT_TYPE_CHARS_MAX, path)
    return obj
