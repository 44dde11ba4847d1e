"""Owners' payouts on the Stripe rail: a Transfer to the owner's connected
account, and the webhooks that take one back.

A requested payout is paid with one Transfer of its amount less its fee, in
cents, under an idempotency key that is a function of the payout alone, so a
retry after a lost answer or a crash, or a second sender running at the same
time, gets the transfer already made, never a second one. Stripe keeps a key
at least 24 hours; a payout requested longer ago is first looked up by its
transfer group (the same text as the key). A Stripe transfer is final once
made, so the payout is recorded sent and settled in one transaction. Stripe
refusing the transfer (no such destination, a card error) fails the payout
back to the owner's earnings; Stripe unreachable, failing (5xx) or refusing
for reasons of the platform's own (its balance, its key, its rate) leaves it
requested for the next run. A connected account that changed since the
payout was requested, or is in its cooldown, is not paid.

A reversed transfer (`transfer.reversed`, `transfer.updated`), received,
stored and parked like every Stripe webhook (app/payments/stripe.py), returns
the whole payout to the owner's earnings once, after Stripe's API confirms
that the transfer is reversed in full. A partial reversal is not returned: the
event is logged and parked for an operator.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta

import stripe
from sqlalchemy import Connection, Engine, select

from app.limits import STRIPE_IDEMPOTENCY_KEY_TRUSTED_S, STRIPE_PAYOUTS_PER_RUN_MAX, STRIPE_TRANSFERS_LISTED_MAX
from app.payments import payouts as po
from app.payments.schema import payouts
from app.payments.stripe_client import NotConfirmed, StripeNotConfigured, StripeSettings, client
from invoices.files import deployment_id
from ledger.errors import InvalidInput
from ledger.money import NANO_USD_PER_CENT
from ledger.schema import utc_now

TRANSFER_CURRENCY = "usd"
NEEDED_BY = "Stripe payouts"
# Error codes of a 4xx answer that say nothing about the payout: the platform's
# balance, key or request rate. The payout waits for the next run instead of failing.
PLATFORM_SIDE_CODES = ("balance_insufficient", "rate_limit", "lock_timeout", "idempotency_key_in_use",
                       "api_key_expired", "platform_api_key_expired")
log = logging.getLogger(__name__)


class NotPayable(InvalidInput):
    code = "payout_not_payable"


class PartlyReversed(Exception):
    """A transfer reversed in part: not a ledger refusal, so its event is parked for an operator."""


@dataclass
class SendReport:
    """What one run did: payouts settled, failed back to earnings, and left requested (with why)."""

    settled: list[int] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    waiting: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def transfer_key(deployment: str, payout_id: int) -> str:
    """The idempotency key and transfer group of every attempt at one payout.
    The database's deployment id keeps two databases on one Stripe account apart."""
    return f"paralon-payout-{deployment}-{payout_id}"


def send_pending(engine: Engine, settings: StripeSettings, *, limit: int = STRIPE_PAYOUTS_PER_RUN_MAX,
                 now: datetime | None = None) -> SendReport:
    """Pay the oldest requested Stripe payouts, at most `limit` of them."""
    sdk = client(settings, NEEDED_BY)
    p = payouts.c
    with engine.connect() as conn:
        deployment = deployment_id(conn)
        rows = conn.execute(select(payouts).where(p.rail == po.STRIPE, p.state == po.REQUESTED).order_by(p.id).limit(limit)).all()
    report = SendReport()
    for row in rows:
        _send(engine, sdk, deployment, dict(row._mapping), now or utc_now(), report)
    return report


def retry(engine: Engine, settings: StripeSettings, payout_id: int, now: datetime | None = None) -> SendReport:
    """Pay one requested Stripe payout now (an operator's retry): the same transfer as every attempt before it."""
    sdk = client(settings, NEEDED_BY)
    with engine.connect() as conn:
        deployment, payout = deployment_id(conn), po.payout_row(conn, payout_id)
    if payout["rail"] != po.STRIPE or payout["state"] != po.REQUESTED:
        raise NotPayable(f"payout {payout_id} is a {payout['rail']} payout {payout['state']}: only requested Stripe payouts are sent")
    report = SendReport()
    _send(engine, sdk, deployment, payout, now or utc_now(), report)
    return report


def _send(engine: Engine, sdk: stripe.StripeClient, deployment: str, payout: dict, now: datetime, report: SendReport) -> None:
    payout_id = payout["id"]
    with engine.connect() as conn:
        unpayable = po.destination_problem(conn, payout, now)
    if unpayable:
        report.waiting.append({"payout_id": payout_id, "reason": unpayable})
        return
    net_nano_usd = payout["amount_nano_usd"] - payout["fee_nano_usd"]
    if net_nano_usd % NANO_USD_PER_CENT:  # a fee not in whole cents (PARALON_PAYOUT_FEE_STRIPE_USD): no exact transfer exists
        _fail(engine, payout_id, f"the amount less the fee, {net_nano_usd} nano-USD, is not whole cents", report)
        return
    params = _transfer_params(deployment, payout, net_nano_usd // NANO_USD_PER_CENT)
    try:
        transfer = _transfer(sdk, params, payout, now)
    except stripe.StripeError as exc:
        _answered_with_error(engine, payout_id, exc, report)
        return
    wrong = _differences(transfer, params)
    if wrong:  # the key's transfer is not this payout's (a database restored from an older backup)
        log.error("transfer %s under the key of payout %s differs: %s", transfer.get("id"), payout_id, wrong)
        report.waiting.append({"payout_id": payout_id, "reason": f"transfer {transfer.get('id')} differs: {wrong}"})
        return
    _record(engine, payout_id, transfer, params, report)


def _transfer_params(deployment: str, payout: dict, cents: int) -> dict:
    key = transfer_key(deployment, payout["id"])
    return {"amount": cents, "currency": TRANSFER_CURRENCY, "destination": payout["destination"],
            "metadata": {"payout_id": str(payout["id"]), "paralon_deployment": deployment},
            "transfer_group": key, "description": f"Paralon payout {payout['id']}"}


def _transfer(sdk: stripe.StripeClient, params: dict, payout: dict, now: datetime) -> dict:
    """The payout's transfer: made now, or the one an earlier attempt made."""
    key = params["transfer_group"]
    if now - payout["requested_at"] >= timedelta(seconds=STRIPE_IDEMPOTENCY_KEY_TRUSTED_S):
        made = sdk.v1.transfers.list(params={"transfer_group": key, "limit": STRIPE_TRANSFERS_LISTED_MAX})
        for transfer in (t.to_dict() for t in made.data):
            if (transfer.get("metadata") or {}).get("payout_id") == params["metadata"]["payout_id"]:
                return transfer
    return sdk.v1.transfers.create(params=params, options={"idempotency_key": key}).to_dict()


def _differences(transfer: dict, params: dict) -> str:
    checked = {"amount": params["amount"], "currency": params["currency"], "destination": params["destination"]}
    wrong = [f"{name} {transfer.get(name)!r} (expected {value!r})" for name, value in checked.items() if transfer.get(name) != value]
    if (transfer.get("metadata") or {}).get("payout_id") != params["metadata"]["payout_id"]:
        wrong.append(f"metadata.payout_id {(transfer.get('metadata') or {}).get('payout_id')!r}")
    return ", ".join(wrong)


def _refused_by_stripe(exc: stripe.StripeError) -> bool:
    """Stripe answered, made no transfer, and the reason is the payout's own
    (its destination, its amount): the payout can fail. Within a key's lifetime
    Stripe replays a transfer already made instead of refusing its key."""
    return isinstance(exc, (stripe.InvalidRequestError, stripe.CardError)) and exc.code not in PLATFORM_SIDE_CODES


def _answered_with_error(engine: Engine, payout_id: int, exc: stripe.StripeError, report: SendReport) -> None:
    said = " ".join(str(part) for part in (type(exc).__name__, exc.http_status or "without an answer", exc.code,
                                            exc.user_message or exc) if part)
    if _refused_by_stripe(exc):
        _fail(engine, payout_id, f"Stripe refused the transfer: {said}", report)
        return
    if isinstance(exc, stripe.IdempotencyError):  # the key was used with other parameters: someone must look
        log.error("payout %s: Stripe refused its idempotency key: %s", payout_id, said)
    else:
        log.warning("payout %s left for the next run: %s", payout_id, said)
    report.waiting.append({"payout_id": payout_id, "reason": said})


def _fail(engine: Engine, payout_id: int, reason: str, report: SendReport) -> None:
    with engine.begin() as conn:
        failed = po.fail(conn, payout_id, reason)
    if failed is not None:
        log.warning("payout %s failed back to earnings: %s", payout_id, reason)
        report.failed.append({"payout_id": payout_id, "reason": reason})


def _record(engine: Engine, payout_id: int, transfer: dict, params: dict, report: SendReport) -> None:
    """Sent and settled in one transaction: a Stripe transfer is final once made."""
    meta = {"destination": params["destination"], "amount_cents": params["amount"], "idempotency_key": params["transfer_group"]}
    with engine.begin() as conn:
        sent = po.record_sent(conn, payout_id, transfer["id"], meta)
        settled = sent is not None and po.settle(conn, payout_id, transfer["id"]) is not None
        state = po.payout_row(conn, payout_id)["state"]
    if settled:
        report.settled.append(payout_id)
    elif state == po.FAILED:  # failed while its transfer was being made: the owner would be paid twice
        log.error("transfer %s was made for payout %s, which failed meanwhile: reverse the transfer on Stripe", transfer["id"], payout_id)


def on_transfer_event(engine: Engine, settings: StripeSettings, transfer: dict) -> str:
    """A transfer changed on Stripe: if Stripe's own record says it is reversed
    in full, the payout it paid returns to the owner's earnings, once."""
    confirmed = _confirmed_transfer(settings, transfer["id"])
    transfer_id = confirmed["id"]
    with engine.connect() as conn:
        deployment = deployment_id(conn)
    metadata = confirmed.get("metadata") or {}
    payout_id = metadata.get("payout_id")
    if metadata.get("paralon_deployment") != deployment or not str(payout_id).isdigit():
        return f"ignored: transfer {transfer_id} is not a payout of this deployment"
    reversed_cents, amount_cents = confirmed["amount_reversed"], confirmed["amount"]
    if not reversed_cents:
        return f"ignored: transfer {transfer_id} of payout {payout_id} is not reversed"
    if reversed_cents < amount_cents:
        log.error("transfer %s of payout %s is reversed in part (%s of %s cents): not returned to earnings; an operator decides",
                  transfer_id, payout_id, reversed_cents, amount_cents)
        raise PartlyReversed(f"transfer {transfer_id} of payout {payout_id} is reversed in part ({reversed_cents} of "
                             f"{amount_cents} cents): partial reversals are not returned automatically")
    with engine.begin() as conn:
        return _take_back(conn, int(payout_id), transfer_id)


def _confirmed_transfer(settings: StripeSettings, transfer_id: str) -> dict:
    """Stripe's own record of the transfer: the event is only what prompts the look."""
    try:
        return client(settings, NEEDED_BY).v1.transfers.retrieve(transfer_id).to_dict()
    except (StripeNotConfigured, stripe.StripeError) as exc:
        raise NotConfirmed(f"cannot retrieve transfer {transfer_id} from Stripe: {exc}") from None


def _take_back(conn: Connection, payout_id: int, transfer_id: str) -> str:
    payout = po.payout_row(conn, payout_id)
    if payout["rail"] != po.STRIPE or payout["reference"] not in (None, transfer_id):
        return f"refused: transfer {transfer_id} is not what paid payout {payout_id} ({payout['rail']}, {payout['reference']})"
    if payout["state"] in po.IN_FLIGHT:  # its transfer was made, its answer not yet recorded: parked until it is
        raise NotConfirmed(f"payout {payout_id} is {payout['state']}: its transfer {transfer_id} is not recorded yet")
    taken = po.reverse_settled(conn, payout_id, f"Stripe reversed transfer {transfer_id}")
    if taken is None:
        return f"nothing new: payout {payout_id} is already {po.payout_row(conn, payout_id)['state']}"
    log.warning("payout %s: Stripe reversed transfer %s; %s nano-USD back to account %s",
                payout_id, transfer_id, taken["amount_nano_usd"], taken["owner_account_id"])
    return f"reversed payout {payout_id}: {taken['amount_nano_usd']} nano-USD back to account {taken['owner_account_id']}"
