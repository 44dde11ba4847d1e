"""Stripe events that cannot be processed are parked, not a blocked queue; and
Stripe's amounts are not taken on trust: a session credits what it was created
for once Stripe's API confirms it paid, and the refunds and disputes of a
charge never take more than the charge. Driven through `paralon serve`'s
webhook route, the `paralon stripe` commands and the Stripe stand-in."""
from __future__ import annotations

import json
import time

import httpx
import orjson
import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from app.cli import main
from app.payments.schema import stripe_events
from tests.app.payments.test_stripe import SECRET, _checkout, _deliver, stripe_setup  # noqa: F401 (a fixture)
from tests.support.harness import wait_for
from tests.support.stripe_standin import dispute_event, refund_event, session_event, signed

NANO_USD_PER_CENT = 10**7
PARKED_METRIC = "paralon_stripe_parked_events"


def _cli(fleet, standin_url: str, *args: str):
    env = {"PARALON_DATABASE_URL": fleet.database_url, "PARALON_STRIPE_SECRET_KEY": "sk_test_standin",
           "PARALON_STRIPE_WEBHOOK_SECRET": SECRET, "PARALON_STRIPE_API_BASE": standin_url}
    return CliRunner().invoke(main, list(args), env=env)


def _json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def _api_url(proxy) -> str:
    return proxy.env["PARALON_STRIPE_API_BASE"]


def _balance(fleet) -> int:
    return fleet.balance(fleet.customer_id).balance_nano_usd


def _outcome(fleet, event_id: str) -> str | None:
    with fleet.engine.connect() as conn:
        return conn.execute(select(stripe_events.c.outcome).where(stripe_events.c.event_id == event_id)).scalar()


def _event_id(payload: bytes) -> str:
    return orjson.loads(payload)["id"]


def _send(fleet, proxy, payload: bytes) -> str:
    """Deliver through the route and wait until the server has processed (or parked) it."""
    assert _deliver(proxy, payload, signed(payload, SECRET)).status_code == 200
    return wait_for(lambda: _outcome(fleet, _event_id(payload)))


def _verified(fleet, proxy) -> None:
    result = _cli(fleet, _api_url(proxy), "ledger", "verify", "--json")
    assert result.exit_code == 0 and _json(result)["ok"], result.output


def _parked_metric(proxy) -> float:
    text = httpx.get(proxy.url + "/metrics").text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(PARKED_METRIC + " "))


def _credited(fleet, proxy, standin, token, dollars: str, payment_intent: str) -> dict:
    """A session this service created, paid on Stripe, credited through the webhook."""
    session = _checkout(proxy, token, dollars).json()
    standin.pay(session["id"], payment_intent=payment_intent)
    stored = {"id": session["id"], "amount_total": session["amount_cents"], "payment_intent": payment_intent}
    assert _send(fleet, proxy, session_event("checkout.session.completed", stored)).startswith("credited")
    return session


def _poison() -> bytes:
    return orjson.dumps({"id": "evt_poison_1", "object": "event", "type": "charge.dispute.created",
                         "api_version": "2026-10-28.endive", "created": int(time.time()), "data": {}})


# --- Item 3: a poison event is parked; the rest is processed --------------------------------------

def test_a_poison_dispute_is_parked_and_the_refund_behind_it_is_processed(stripe_setup):
    from app.payments.stripe import receive_webhook

    fleet, proxy, standin, token, _ = stripe_setup
    _credited(fleet, proxy, standin, token, "25.00", "pi_p")
    settings = type("S", (), {"webhook_secret": SECRET})()
    poison, refund = _poison(), refund_event("ch_p", "pi_p", 2500, 1000)
    for payload in (poison, refund):  # stored, then the process stopped before processing them
        assert receive_webhook(fleet.engine, settings, payload, signed(payload, SECRET))

    result = _cli(fleet, _api_url(proxy), "stripe", "process-pending", "--json")
    assert result.exit_code == 0, result.output
    outcomes = {p["event_id"]: p["outcome"] for p in _json(result)["processed"]}
    assert outcomes[_event_id(refund)].startswith("refunded 1000 cents")
    assert outcomes["evt_poison_1"].startswith("parked")
    assert _balance(fleet) == 15 * 10**9

    failed = _cli(fleet, _api_url(proxy), "stripe", "failed", "--json")
    assert failed.exit_code == 0, failed.output
    [parked] = _json(failed)["failed"]
    assert parked["event_id"] == "evt_poison_1" and parked["attempts"] == 1 and parked["next_attempt_at"]
    assert "data.object" in parked["last_error"]
    assert _parked_metric(proxy) == 1

    again = _cli(fleet, _api_url(proxy), "stripe", "process-pending", "--json")
    assert again.exit_code == 0 and _json(again)["processed"] == [], "not retried before its backoff is over"

    replayed = _cli(fleet, _api_url(proxy), "stripe", "replay", "evt_poison_1", "--json")
    assert replayed.exit_code == 1, replayed.output
    assert _json(replayed)["status"] == "parked" and _json(replayed)["attempts"] == 2
    assert "data.object" in _json(replayed)["last_error"]
    assert _balance(fleet) == 15 * 10**9 and _parked_metric(proxy) == 1
    _verified(fleet, proxy)


def test_replay_of_an_unknown_or_processed_event_is_refused_with_one_line(stripe_setup):
    fleet, proxy, standin, token, _ = stripe_setup
    _credited(fleet, proxy, standin, token, "5.00", "pi_u")
    for event_id in ("evt_never_seen", "x" * 300):
        result = _cli(fleet, _api_url(proxy), "stripe", "replay", event_id)
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    with fleet.engine.connect() as conn:
        processed = conn.execute(select(stripe_events.c.event_id)).scalar_one()
    result = _cli(fleet, _api_url(proxy), "stripe", "replay", processed)
    assert result.exit_code == 2 and "processed" in result.output
    assert _balance(fleet) == 5 * 10**9


def test_a_parked_event_replays_to_processed_once_stripe_confirms_it(stripe_setup):
    fleet, proxy, standin, token, _ = stripe_setup
    session = _checkout(proxy, token, "5.00").json()
    claim = session_event("checkout.session.completed", {"id": session["id"], "amount_total": 500, "payment_intent": "pi_r"})
    assert _send(fleet, proxy, claim).startswith("parked"), "the event says paid, Stripe's API says unpaid"
    assert _balance(fleet) == 0 and fleet.events("CreditsPurchased") == 0 and _parked_metric(proxy) == 1
    [parked] = _json(_cli(fleet, _api_url(proxy), "stripe", "failed", "--json"))["failed"]
    assert "payment_status" in parked["last_error"]

    standin.pay(session["id"], payment_intent="pi_r")
    replayed = _cli(fleet, _api_url(proxy), "stripe", "replay", _event_id(claim), "--json")
    assert replayed.exit_code == 0, replayed.output
    assert _json(replayed)["status"] == "processed" and _json(replayed)["outcome"].startswith("credited 500 cents")
    assert _balance(fleet) == 5 * 10**9 and fleet.events("CreditsPurchased") == 1
    assert _json(_cli(fleet, _api_url(proxy), "stripe", "failed", "--json"))["failed"] == []
    assert _parked_metric(proxy) == 0
    _verified(fleet, proxy)


BAD_SHAPES = [
    ("checkout.session.completed", {"object": {"id": 5, "amount_total": 500}}, "data.object.id"),
    ("checkout.session.completed", {"object": ["cs_1"]}, "data.object"),
    ("charge.refunded", {"object": {"id": "ch_s", "payment_intent": "pi_s", "amount_refunded": "700"}}, "amount_refunded"),
    ("charge.refunded", {"object": {"id": "ch_s", "amount_refunded": 700}}, "payment_intent"),
    ("charge.dispute.created", {"object": {"id": "dp_s", "payment_intent": "pi_s", "amount": -700, "status": "x"}}, "amount"),
    ("charge.dispute.closed", {"object": {"id": "dp_s", "payment_intent": "pi_s", "amount": 700}}, "status"),
    ("charge.dispute.created", {"object": {"id": {"x": 1}, "payment_intent": "pi_s", "amount": 700, "status": "x"}}, "data.object.id"),
]


def test_an_event_of_the_wrong_shape_is_parked_with_a_clear_error(stripe_setup):
    """Each shape on one service, one after the other: a parked event changes nothing the next one meets."""
    fleet, proxy, standin, token, _ = stripe_setup
    _credited(fleet, proxy, standin, token, "7.00", "pi_s")
    for i, (event_type, data, named) in enumerate(BAD_SHAPES):
        event_id = f"evt_shape_{i}"
        payload = orjson.dumps({"id": event_id, "object": "event", "type": event_type, "created": int(time.time()), "data": data})
        assert _send(fleet, proxy, payload).startswith("parked"), (event_type, data)
        parked = {e["event_id"]: e for e in _json(_cli(fleet, _api_url(proxy), "stripe", "failed", "--json"))["failed"]}
        assert len(parked) == i + 1, (event_type, data)
        assert named in parked[event_id]["last_error"] and parked[event_id]["event_type"] == event_type, parked[event_id]
        assert _balance(fleet) == 7 * 10**9
    _verified(fleet, proxy)


MALFORMED_ENVELOPES = [
    {"id": {"nested": "object"}, "type": "charge.refunded"},
    {"id": 12345, "type": "charge.refunded"},
    {"id": "", "type": "charge.refunded"},
    {"id": "evt_" + "x" * 300, "type": "charge.refunded"},
    {"id": "evt_ok", "type": ["charge.refunded"]},
    {"id": "evt_ok", "type": "x" * 101},
]


def test_a_signed_event_with_a_malformed_envelope_is_a_400_and_stores_nothing(stripe_setup):
    fleet, proxy, _, _, _ = stripe_setup
    for envelope in MALFORMED_ENVELOPES:
        payload = orjson.dumps({**envelope, "object": "event", "data": {"object": {}}})
        response = _deliver(proxy, payload, signed(payload, SECRET))
        assert response.status_code == 400 and response.json()["error"]["message"], envelope
        with fleet.engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(stripe_events)).scalar() == 0, envelope
        assert _balance(fleet) == 0


def test_retries_back_off_and_stop_after_the_bounded_number_of_attempts(database_url):
    """Each failed attempt waits longer (up to the limit); after the last one the
    event stays parked until an operator replays it."""
    from datetime import timedelta

    from app.limits import STRIPE_EVENT_ATTEMPTS_MAX, STRIPE_RETRY_BACKOFF_S_BASE, STRIPE_RETRY_BACKOFF_S_MAX
    from app.payments.stripe import StripeSettings, parked_events, process_pending, receive_webhook
    from ledger.schema import utc_now
    from tests.support.harness import make_fleet

    fleet = make_fleet(database_url, [], credits_usd="0")
    settings = StripeSettings("sk_test_unused", SECRET, None, 500, 1_000_000, "http://x/done", "http://x/cancelled")
    poison = _poison()
    receive_webhook(fleet.engine, settings, poison, signed(poison, SECRET))
    now, delays_s = utc_now(), []
    for attempt in range(1, STRIPE_EVENT_ATTEMPTS_MAX + 1):
        assert [e for e, _ in process_pending(fleet.engine, settings, now=now)] == ["evt_poison_1"]
        [parked] = parked_events(fleet.engine)
        assert parked["attempts"] == attempt
        if attempt < STRIPE_EVENT_ATTEMPTS_MAX:
            delays_s.append((parked["next_attempt_at"] - now).total_seconds())
            assert process_pending(fleet.engine, settings, now=parked["next_attempt_at"] - timedelta(seconds=1)) == []
            now = parked["next_attempt_at"]
    assert parked["next_attempt_at"] is None, "no more automatic attempts"
    assert process_pending(fleet.engine, settings, now=now + timedelta(days=365)) == []
    assert delays_s[0] == STRIPE_RETRY_BACKOFF_S_BASE and delays_s == sorted(delays_s)
    assert max(delays_s) <= STRIPE_RETRY_BACKOFF_S_MAX
    assert _balance(fleet) == 0
    fleet.engine.dispose()


def test_the_beat_retries_parked_events_once_they_are_due(database_url, monkeypatch):
    from datetime import timedelta

    from app.jobs.celery import celery
    from app.payments.stripe import StripeSettings, parked_events, process_pending, receive_webhook
    from ledger.schema import utc_now
    from tests.support.harness import make_fleet

    fleet = make_fleet(database_url, [], credits_usd="0")
    settings = StripeSettings("sk_test_unused", SECRET, None, 500, 1_000_000, "http://x/done", "http://x/cancelled")
    poison = _poison()
    receive_webhook(fleet.engine, settings, poison, signed(poison, SECRET))
    process_pending(fleet.engine, settings, now=utc_now() - timedelta(days=1))  # parked a day ago: due now
    monkeypatch.setenv("PARALON_DATABASE_URL", database_url)
    retry = celery.tasks["paralon.stripe_retry_parked"]
    assert retry.apply(throw=True).get() == 1
    assert retry.apply(throw=True).get() == 0, "parked again, not due before its backoff"
    assert parked_events(fleet.engine)[0]["attempts"] == 2 and _balance(fleet) == 0
    fleet.engine.dispose()


# --- Item 4: Stripe's amounts are not taken on trust ----------------------------------------------

@pytest.mark.parametrize(("stripe_says", "credited_cents"), [
    ({}, 500),  # Stripe confirms $5 paid: exactly $5, whatever the event claims
    ({"amount_total": 900_000}, 0),  # Stripe's session is not what this service asked for
    ({"currency": "eur"}, 0),
    ({"payment_status": "unpaid", "status": "open"}, 0),
])
def test_a_session_credits_what_it_was_created_for_once_stripe_confirms_it(stripe_setup, stripe_says, credited_cents):
    fleet, proxy, standin, token, _ = stripe_setup
    session = _checkout(proxy, token, "5.00").json()
    standin.pay(session["id"], payment_intent="pi_9k")
    standin.sessions_by_id[session["id"]].update(stripe_says)
    claim = session_event("checkout.session.completed", {"id": session["id"], "amount_total": 900_000, "payment_intent": "pi_9k"})
    outcome = _send(fleet, proxy, claim)
    assert _balance(fleet) == credited_cents * NANO_USD_PER_CENT
    assert fleet.events("CreditsPurchased") == (1 if credited_cents else 0)
    assert outcome.startswith("credited" if credited_cents else "parked"), outcome
    assert any(r["path"] == f"/v1/checkout/sessions/{session['id']}" for r in standin.requests), "asked Stripe's API"
    _verified(fleet, proxy)


def _dispute(kind: str, dispute_id: str, amount: int, status: str = "needs_response") -> bytes:
    return dispute_event(f"charge.dispute.{kind}", dispute_id, "pi_7", amount, status)


SEQUENCES = {
    "two disputes with new ids and a refund": [_dispute("created", "dp_1", 700), _dispute("created", "dp_2", 700),
                                               refund_event("ch_7", "pi_7", 700, 700)],
    "a refund after a dispute of the full amount": [_dispute("created", "dp_1", 700), refund_event("ch_7", "pi_7", 700, 700)],
    "a dispute after a full refund": [refund_event("ch_7", "pi_7", 700, 700), _dispute("created", "dp_1", 700),
                                      _dispute("closed", "dp_1", 700, "lost")],
    "two disputes lost one after the other": [_dispute("created", "dp_1", 700), _dispute("closed", "dp_1", 700, "lost"),
                                              _dispute("created", "dp_2", 700), _dispute("closed", "dp_2", 700, "lost")],
    "partial refunds around a dispute": [refund_event("ch_7", "pi_7", 700, 300), _dispute("created", "dp_1", 700),
                                         refund_event("ch_7", "pi_7", 700, 600), _dispute("created", "dp_2", 500)],
}


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_refunds_and_disputes_of_a_charge_take_at_most_the_charge(stripe_setup, name):
    fleet, proxy, standin, token, _ = stripe_setup
    _credited(fleet, proxy, standin, token, "7.00", "pi_7")
    for payload in SEQUENCES[name]:  # each new: Stripe sends every event with an id of its own
        _send(fleet, proxy, orjson.dumps({**orjson.loads(payload), "id": f"evt_{name[:8]}_{time.monotonic_ns()}"}))
    assert _balance(fleet) == 0, "the $7 charge took $7, no more"
    _verified(fleet, proxy)


def test_a_dispute_won_returns_only_what_it_froze(stripe_setup):
    """A won dispute gives back what it froze; the bound then makes room for what is refunded later."""
    fleet, proxy, standin, token, _ = stripe_setup
    _credited(fleet, proxy, standin, token, "7.00", "pi_7")
    for payload in (refund_event("ch_7", "pi_7", 700, 300), _dispute("created", "dp_1", 700), _dispute("created", "dp_2", 700)):
        _send(fleet, proxy, payload)
    assert _balance(fleet) == 0
    _send(fleet, proxy, _dispute("closed", "dp_1", 700, "won"))
    assert _balance(fleet) == 400 * NANO_USD_PER_CENT, "dp_1 froze the $4 that was left; dp_2 froze nothing"
    _send(fleet, proxy, _dispute("closed", "dp_2", 700, "won"))
    assert _balance(fleet) == 400 * NANO_USD_PER_CENT
    _send(fleet, proxy, refund_event("ch_7", "pi_7", 700, 700))
    assert _balance(fleet) == 0
    _verified(fleet, proxy)


@pytest.mark.parametrize("status", ["warning_closed", "prevented"])
def test_a_dispute_closed_without_a_chargeback_releases_what_it_froze(stripe_setup, status):
    """Not only "won": an inquiry closed without a chargeback, or a prevented dispute,
    leaves the money with the merchant, so the frozen credits are the customer's again."""
    fleet, proxy, standin, token, _ = stripe_setup
    _credited(fleet, proxy, standin, token, "7.00", "pi_7")
    _send(fleet, proxy, _dispute("created", "dp_1", 700))
    assert _balance(fleet) == 0
    assert _send(fleet, proxy, _dispute("closed", "dp_1", 700, status)).startswith(f"dispute dp_1 {status}")
    assert _balance(fleet) == 7 * 10**9 and fleet.events("EventReversed") == 1
    _verified(fleet, proxy)
