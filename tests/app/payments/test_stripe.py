"""Card top-ups through Stripe Checkout, offline: the real `stripe` SDK against
a local stand-in for Stripe's API, webhooks signed with Stripe's scheme."""
from __future__ import annotations

import time

import httpx
import orjson
import pytest
from sqlalchemy import func, select

from app.outbox import outbox
from app.payments.schema import stripe_checkout_sessions, stripe_events
from app.payments.stripe import StripeSettings, amount_cents
from app.tokens import create_token
from ledger.errors import InvalidAmount
from tests.support.stripe_standin import StripeStandIn, session_event, signed
from tests.support.harness import ThreadedServer, make_fleet, serving, wait_for

SECRET = "whsec_test_secret"


@pytest.fixture
def stripe_setup(database_url):
    standin = StripeStandIn()
    api = ThreadedServer(standin).start()
    fleet = make_fleet(database_url, [], credits_usd="0")
    with fleet.engine.begin() as conn:
        token = create_token(conn, fleet.customer_id, "customer")[1]
        accountant = create_token(conn, fleet.customer_id, "accountant")[1]
    env = {"PARALON_STRIPE_SECRET_KEY": "sk_test_standin", "PARALON_STRIPE_WEBHOOK_SECRET": SECRET,
           "PARALON_STRIPE_API_BASE": api.url}
    with serving(database_url, **env) as proxy:
        yield fleet, proxy, standin, token, accountant
    api.stop()
    fleet.engine.dispose()


def _checkout(proxy, token, amount, key=None):
    headers = {"authorization": f"Bearer {token}"}
    if key:
        headers["idempotency-key"] = key
    return httpx.post(proxy.url + "/v1/credits/checkout", json={"amount_usd": amount}, headers=headers, timeout=30)


def _deliver(proxy, payload: bytes, signature: str | None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if signature is not None:
        headers["stripe-signature"] = signature
    # Patient: without a broker the service renders the last top-up's invoice in its own process.
    return httpx.post(proxy.url + "/webhooks/stripe", content=payload, headers=headers, timeout=30)


def _counts(fleet) -> tuple[int, int, int]:
    with fleet.engine.connect() as conn:
        sessions = conn.execute(select(func.count()).select_from(stripe_checkout_sessions)).scalar()
        events = conn.execute(select(func.count()).select_from(stripe_events)).scalar()
    return sessions, events, fleet.balance(fleet.customer_id).balance_nano_usd


def test_a_checkout_session_is_created_for_the_callers_account(stripe_setup):
    fleet, proxy, standin, token, _ = stripe_setup
    first = _checkout(proxy, token, "25.00", key="click-1")
    assert first.status_code == 201 and first.json()["url"].startswith("https://checkout.stripe.test/")
    again = _checkout(proxy, token, "25.00", key="click-1")
    assert again.json()["id"] == first.json()["id"], "a retried click gets the same session"
    sent = standin.requests[0]
    assert sent["headers"]["stripe-version"] == "2026-10-28.endive"
    assert sent["headers"]["idempotency-key"].startswith("paralon-checkout-")
    assert sent["form"]["client_reference_id"] == str(fleet.customer_id)
    assert sent["form"]["metadata[paralon_account_id]"] == str(fleet.customer_id)
    assert sent["form"]["line_items[0][price_data][unit_amount]"] == "2500"
    assert _counts(fleet)[:1] == (1,)


def test_a_bad_amount_is_refused_and_nothing_is_created(stripe_setup):
    fleet, proxy, standin, token, _ = stripe_setup
    for amount in ["4.99", "10000.01", "25.001", "abc", "-5", "NaN"]:
        response = _checkout(proxy, token, amount)
        assert response.status_code == 400 and response.json()["error"]["param"] == "amount_usd", amount
        assert standin.requests == [] and _counts(fleet) == (0, 0, 0), amount


def test_only_a_customer_token_starts_a_checkout(stripe_setup):
    fleet, proxy, standin, _, accountant = stripe_setup
    assert _checkout(proxy, accountant, "25.00").status_code == 403
    assert _checkout(proxy, fleet.key, "25.00").status_code == 401, "an API key is not a management token"
    assert standin.requests == []


def test_a_paid_session_is_credited_exactly_once_whatever_the_copies(stripe_setup):
    fleet, proxy, standin, token, _ = stripe_setup
    session = _checkout(proxy, token, "25.00").json()
    standin.pay(session["id"])
    stored = {"id": session["id"], "amount_total": 2500, "client_reference_id": str(fleet.customer_id)}
    completed = session_event("checkout.session.completed", stored)
    for _ in range(3):  # Stripe retries: the same event, more than once
        assert _deliver(proxy, completed, signed(completed, SECRET)).status_code == 200
    succeeded = session_event("checkout.session.async_payment_succeeded", stored)
    assert _deliver(proxy, succeeded, signed(succeeded, SECRET)).status_code == 200
    wait_for(lambda: fleet.balance(fleet.customer_id).balance_nano_usd == 25 * 10**9)
    wait_for(lambda: _processed(fleet) == 2)
    assert fleet.events("CreditsPurchased") == 1 and _counts(fleet)[1] == 2
    with fleet.engine.connect() as conn:
        from ledger.schema import ledger_events

        payload = orjson.loads(conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == "CreditsPurchased")).scalar_one())
    assert payload["payment_method"] == "card" and session["id"] in payload["external_reference"]


def _processed(fleet) -> int:
    with fleet.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(stripe_events).where(stripe_events.c.processed_at.is_not(None))).scalar()


def _outbox_sent(fleet) -> bool:
    """Every invoice and credit note written to the outbox has been issued: without a
    broker the task runs at the send, and the row is marked sent after it."""
    with fleet.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(outbox).where(outbox.c.dispatched_at.is_(None))).scalar() == 0


def test_bad_webhooks_store_nothing_and_credit_nothing(stripe_setup):
    fleet, proxy, standin, token, _ = stripe_setup
    session = _checkout(proxy, token, "25.00").json()
    event = session_event("checkout.session.completed", {"id": session["id"], "amount_total": 2500})
    tampered = event.replace(b"2500", b"9900")
    stale = signed(event, SECRET, timestamp=int(time.time()) - 3600)
    for payload, signature in ((event, None), (event, "t=1,v1=00"), (tampered, signed(event, SECRET)), (event, stale),
                               (event, signed(event, "whsec_other"))):
        response = _deliver(proxy, payload, signature)
        assert response.status_code == 400 and response.json()["error"]["code"] == "bad_signature"
    assert _counts(fleet) == (1, 0, 0)


def test_events_this_service_cannot_credit(stripe_setup):
    fleet, proxy, standin, token, _ = stripe_setup
    session = _checkout(proxy, token, "25.00").json()
    foreign = session_event("checkout.session.completed", {"id": "cs_test_not_ours", "amount_total": 2500})
    unpaid = session_event("checkout.session.completed", {"id": session["id"], "amount_total": 2500}, paid=False)
    other = session_event("customer.created", {"id": "cus_1"})
    for payload in (foreign, unpaid, other):
        assert _deliver(proxy, payload, signed(payload, SECRET)).status_code == 200
    wait_for(lambda: _processed(fleet) == 3)
    assert fleet.balance(fleet.customer_id).balance_nano_usd == 0 and fleet.events("CreditsPurchased") == 0


def test_an_event_stored_but_not_processed_is_picked_up_by_the_cli(stripe_setup):
    """The process may stop between answering Stripe and processing: the stored
    event is processed later, once."""
    from click.testing import CliRunner

    from app.cli import main
    from app.payments.stripe import receive_webhook

    fleet, proxy, standin, token, _ = stripe_setup
    session = _checkout(proxy, token, "7.50").json()
    standin.pay(session["id"])
    event = session_event("checkout.session.completed", {"id": session["id"], "amount_total": 750})
    settings = type("S", (), {"webhook_secret": SECRET})()
    assert receive_webhook(fleet.engine, settings, event, signed(event, SECRET))  # stored, not processed
    runner = CliRunner()
    env = {"PARALON_DATABASE_URL": fleet.database_url, "PARALON_STRIPE_SECRET_KEY": "sk_test_standin",
           "PARALON_STRIPE_API_BASE": proxy.env["PARALON_STRIPE_API_BASE"]}  # it asks Stripe's API before crediting
    for _ in range(2):
        result = runner.invoke(main, ["stripe", "process-pending", "--json"], env=env)
        assert result.exit_code == 0, result.output
    assert fleet.balance(fleet.customer_id).balance_nano_usd == 750 * 10**7 and fleet.events("CreditsPurchased") == 1


def _paid(standin, proxy, token, dollars: str, payment_intent: str) -> dict:
    """A session created and paid on Stripe; what its completed event carries."""
    session = _checkout(proxy, token, dollars).json()
    standin.pay(session["id"], payment_intent=payment_intent)
    return {"id": session["id"], "amount_total": int(float(dollars) * 100), "payment_intent": payment_intent}


def test_refunds_in_any_order_and_any_copies_refund_once_and_spent_credits_become_a_debt(stripe_setup):
    from ledger import commands as cmd
    from ledger.errors import InsufficientFunds
    from ledger.holds import PlaceHold
    from ledger.service import Ledger, append_now
    from tests.support.stripe_standin import refund_event

    fleet, proxy, standin, token, _ = stripe_setup
    session = _paid(standin, proxy, token, "25.00", "pi_1")
    early = refund_event("ch_1", "pi_1", 2500, 500)  # arrives before the payment is even credited
    assert _deliver(proxy, early, signed(early, SECRET)).status_code == 200
    paid = session_event("checkout.session.completed", session)
    _deliver(proxy, paid, signed(paid, SECRET))
    wait_for(lambda: fleet.balance(fleet.customer_id).balance_nano_usd == 20 * 10**9)  # 25 credited, 5 refunded

    append_now(fleet.engine, cmd.AdjustBalance(fleet.customer_id, -18 * 10**9, "spent on requests", "spend"))
    later, late_copy = refund_event("ch_1", "pi_1", 2500, 2500), refund_event("ch_1", "pi_1", 2500, 1000)
    for payload in (later, later, late_copy, early):
        _deliver(proxy, payload, signed(payload, SECRET))
    wait_for(lambda: _processed(fleet) == 4)  # copies of an event are stored once
    view = fleet.balance(fleet.customer_id)
    assert view.balance_nano_usd == 25 * 10**9 - 18 * 10**9 - 25 * 10**9, "refunded in full, once: 18 USD of debt"
    assert fleet.events("CreditsRefunded") == 2

    ledger = Ledger(fleet.engine)
    with pytest.raises(InsufficientFunds):  # the debt blocks new requests
        ledger.place_hold(PlaceHold(fleet.customer_id, 1, "after-debt"))
    repay = session_event("checkout.session.completed", _paid(standin, proxy, token, "20.00", "pi_2"))
    _deliver(proxy, repay, signed(repay, SECRET))
    wait_for(lambda: fleet.balance(fleet.customer_id).balance_nano_usd == 2 * 10**9)
    assert ledger.place_hold(PlaceHold(fleet.customer_id, 10**9, "after-repay")).amount_nano_usd == 10**9
    ledger.close()
    from ledger.verify import verify

    wait_for(lambda: _outbox_sent(fleet))  # no invoice is being recorded while verify reads
    with fleet.engine.connect() as conn:
        assert verify(conn).ok, "a debt from a refund passes verify"


@pytest.mark.parametrize("outcome", ["won", "lost"])
@pytest.mark.parametrize("close_first", [False, True])
def test_a_dispute_freezes_then_releases_or_forfeits_in_any_order(stripe_setup, outcome, close_first):
    from tests.support.stripe_standin import dispute_event

    fleet, proxy, standin, token, _ = stripe_setup
    paid = session_event("checkout.session.completed", _paid(standin, proxy, token, "25.00", "pi_d"))
    _deliver(proxy, paid, signed(paid, SECRET))
    wait_for(lambda: fleet.balance(fleet.customer_id).balance_nano_usd == 25 * 10**9)
    created = dispute_event("charge.dispute.created", "dp_1", "pi_d", 1000, "needs_response")
    closed = dispute_event("charge.dispute.closed", "dp_1", "pi_d", 1000, outcome)
    events = [closed, created, closed] if close_first else [created, created, closed]
    _deliver(proxy, events[0], signed(events[0], SECRET))
    if not close_first:
        wait_for(lambda: fleet.balance(fleet.customer_id).balance_nano_usd == 15 * 10**9)  # frozen meanwhile
    for payload in events[1:]:
        _deliver(proxy, payload, signed(payload, SECRET))
    wait_for(lambda: _processed(fleet) == 3)
    expected = 25 * 10**9 if outcome == "won" else 15 * 10**9
    assert fleet.balance(fleet.customer_id).balance_nano_usd == expected
    assert fleet.events("CreditsFrozen") == 1
    assert fleet.events("EventReversed" if outcome == "won" else "FrozenCreditsForfeited") == 1
    from ledger.verify import verify

    wait_for(lambda: _outbox_sent(fleet))  # no credit note is being recorded while verify reads
    with fleet.engine.connect() as conn:
        assert verify(conn).ok


def test_malformed_bodies_are_refused_and_store_nothing(stripe_setup):
    fleet, proxy, standin, token, _ = stripe_setup
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    for body in (b"{not json", b"[1, 2]", b"{}"):
        response = httpx.post(proxy.url + "/v1/credits/checkout", content=body, headers=headers)
        assert response.status_code == 400 and response.json()["error"]["message"]
    not_an_event = b'{"hello": "world"}'
    response = _deliver(proxy, not_an_event, signed(not_an_event, SECRET))
    assert response.status_code == 400
    assert standin.requests == [] and _counts(fleet) == (0, 0, 0)


def test_every_credit_gets_an_invoice_and_every_refund_a_credit_note(stripe_setup):
    """The outbox issues them after the commits: invoice PAR-…, credit note PARCN-… correcting it."""
    from invoices.service import list_invoices
    from tests.support.stripe_standin import refund_event

    fleet, proxy, standin, token, _ = stripe_setup
    paid = session_event("checkout.session.completed", _paid(standin, proxy, token, "25.00", "pi_cn"))
    _deliver(proxy, paid, signed(paid, SECRET))
    refund = refund_event("ch_cn", "pi_cn", 2500, 1000)
    _deliver(proxy, refund, signed(refund, SECRET))
    def issued():
        documents = list_invoices(fleet.engine, fleet.customer_id)
        return len(documents) == 2 and all(d["pdf_sha256"] for d in documents) and documents

    documents = wait_for(issued)
    invoice, credit_note = sorted(documents, key=lambda d: d["kind"] != "invoice")
    assert invoice["number"].startswith("PAR-") and invoice["amount_nano_usd"] == 25 * 10**9
    assert credit_note["number"].startswith("PARCN-") and credit_note["corrects"] == invoice["number"]
    assert credit_note["amount_nano_usd"] == 10 * 10**9 and fleet.events("InvoiceIssued") == 2


CHECKOUT_LIMITS = StripeSettings(secret_key=None, webhook_secret=None, api_base=None, checkout_min_cents=500,
                                 checkout_max_cents=1_000_000, success_url="http://x/done", cancel_url="http://x/cancelled")


@pytest.mark.parametrize("amount", ["1e26", 1e30, "1e999999999", "١٢", "1_000", "25.5e0", True])
def test_an_amount_decimal_alone_would_take_is_refused_as_a_bad_amount(amount):
    """Exponents that overflow, other scripts' digits and underscores are a 400
    about amount_usd (InvalidAmount), not a server error."""
    with pytest.raises(InvalidAmount):
        amount_cents(amount, CHECKOUT_LIMITS)


def test_a_plain_amount_within_the_limits_is_its_cents():
    assert [amount_cents(a, CHECKOUT_LIMITS) for a in ("25.00", "5", 10000, "9999.99")] == [2500, 500, 1_000_000, 999_999]
