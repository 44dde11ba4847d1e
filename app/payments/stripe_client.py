"""What every use of Stripe's API shares: the settings, the pinned API version
and the SDK's client built from them. Card top-ups (app/payments/stripe.py)
and owners' Stripe payouts (app/payments/payout_stripe.py) both call Stripe
through `client`."""
from __future__ import annotations

from dataclasses import dataclass, field

import stripe

from app.limits import STRIPE_NETWORK_RETRIES_MAX
from ledger.errors import InvalidInput

STRIPE_API_VERSION = "2026-10-28.endive"  # pinned: the shapes this service reads


class StripeNotConfigured(InvalidInput):
    code = "stripe_not_configured"


class NotConfirmed(Exception):
    """Stripe's API does not confirm what an event says (or cannot be asked):
    not a ledger refusal, so the event is parked and tried again."""


@dataclass(frozen=True)
class StripeSettings:
    secret_key: str | None = field(repr=False)  # secrets stay out of reprs and logs
    webhook_secret: str | None = field(repr=False)
    api_base: str | None
    checkout_min_cents: int
    checkout_max_cents: int
    success_url: str
    cancel_url: str


def client(settings: StripeSettings, needed_by: str) -> stripe.StripeClient:
    """The SDK's client, at PARALON_STRIPE_API_BASE when it is set; `needed_by` names what is refused without a key."""
    if not settings.secret_key:
        raise StripeNotConfigured(f"{needed_by} need PARALON_STRIPE_SECRET_KEY")
    addresses = {"api": settings.api_base} if settings.api_base else None
    return stripe.StripeClient(settings.secret_key, stripe_version=STRIPE_API_VERSION, base_addresses=addresses,
                               max_network_retries=STRIPE_NETWORK_RETRIES_MAX)
