"""Owners' payouts on the Stripe rail, offline: the real `stripe` SDK against the
local stand-in of Stripe's API, webhooks signed with Stripe's scheme. A
requested payout is paid with one Transfer of its cents and settled; lost
answers, retries and two senders at once never make a second transfer; Stripe
refusing fails it back to earnings, Stripe failing leaves it requested; a
reversed transfer returns it to earnings once, however many events say so.
Every case reads the owner's earnings, the rail's in-flight and paid accounts
and the platform's revenue, and every failure shows that nothing moved."""
from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from app.jobs.celery import PAYOUTS_SEND_STRIPE, celery
from app.payments import payout_stripe as ps
from app.payments import payouts as po
from app.payments.schema import stripe_events
from app.payments.stripe import StripeSettings, process_event, process_pending, receive_webhook
from invoices.files import deployment_id
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.schema import accounts, ledger_events
from ledger.service import append_now
from ledger.verify import verify
from tests.app.payments.test_stripe import _deliver
from tests.support.harness import ThreadedServer, serving, wait_for
from tests.support.stripe_standin import (
    BALANCE_INSUFFICIENT,
    LOST_ANSWER,
    SERVER_ERROR,
    StripeStandIn,
    signed,
    transfer_event,
)

USD = 10**9
CENT = 10**7
CONNECTED = "acct_1OwnerPaid"
MOVED = "acct_1OwnerMoved"
FEE_NANO_USD = 25 * CENT
RULES = po.PayoutRules(min_nano_usd=10 * USD, fee_nano_usd={po.USDC: 0, po.STRIPE: FEE_NANO_USD})
SECRET = "whsec_payout_test"
API_KEY = "sk_test_standin"
SENDERS = 2


@pytest.fixture
def stripe_api():
    """The stand-in on a port of its own, and settings that point the SDK at it."""
    standin = StripeStandIn()
    server = ThreadedServer(standin).start()
    settings = StripeSettings(secret_key=API_KEY, webhook_secret=SECRET, api_base=server.url, checkout_min_cents=500,
                              checkout_max_cents=1_000_000, success_url="http://127.0.0.1/done", cancel_url="http://127.0.0.1/cancelled")
    try:
        yield standin, settings
    finally:
        server.stop()


@pytest.fixture
def owner(engine) -> int:
    """An owner with $100 of earnings and a connected account."""
    with engine.begin() as conn:
        owner_id = acc.create_account(conn, cmd.OWNER, "gpu owner")
        po.set_destination(conn, owner_id, po.STRIPE, CONNECTED)
    append_now(engine, cmd.AdjustBalance(owner_id, 100 * USD, "earnings for the test", f"earn:{owner_id}"))
    return owner_id


def books(engine, owner_id: int) -> dict[str, int]:
    """The owner's earnings, the Stripe rail's in-flight and paid accounts, the platform's revenue."""
    codes = {"in_flight": cmd.payouts_in_flight_account(po.STRIPE), "paid": cmd.payouts_paid_account(po.STRIPE),
             "revenue": cmd.PLATFORM_REVENUE_ACCOUNT}
    with engine.connect() as conn:
        ids = dict(conn.execute(select(accounts.c.system_code, accounts.c.id).where(accounts.c.system_code.in_(codes.values()))).all())
        wanted = {"owner": owner_id, **{name: ids[code] for name, code in codes.items()}}
        read = acc.read_books(conn, list(wanted.values()))
    return {name: read[account_id].balance_nano_usd for name, account_id in wanted.items()}


REQUESTED_40 = {"owner": 60 * USD, "in_flight": 40 * USD, "paid": 0, "revenue": 0}  # $40 asked of $100
PAID_40 = {"owner": 60 * USD, "in_flight": 0, "paid": 40 * USD - FEE_NANO_USD, "revenue": FEE_NANO_USD}
UNTOUCHED = {"owner": 100 * USD, "in_flight": 0, "paid": 0, "revenue": 0}


def _requested(engine, owner_id: int) -> dict:
    payout = po.request_payout(engine, owner_id, po.STRIPE, 40 * USD, RULES)
    assert books(engine, owner_id) == REQUESTED_40
    return payout


def _payout(engine, payout_id: int) -> dict:
    with engine.connect() as conn:
        return po.payout_row(conn, payout_id)


def _events(engine, event_type: str) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(ledger_events).where(ledger_events.c.event_type == event_type)).scalar()


def _key(engine, payout_id: int) -> str:
    with engine.connect() as conn:
        return ps.transfer_key(deployment_id(conn), payout_id)


def _verified(engine) -> None:
    with engine.connect() as conn:
        assert verify(conn).ok


def _paid(engine, standin, settings, owner_id: int) -> dict:
    """A $40 payout requested, paid and settled: the settled row."""
    payout = _requested(engine, owner_id)
    assert ps.send_pending(engine, settings).settled == [payout["id"]]
    assert books(engine, owner_id) == PAID_40
    return _payout(engine, payout["id"])


# --- Paying -----------------------------------------------------------------------


def test_a_requested_payout_is_paid_with_one_transfer_of_its_cents_and_settled(engine, stripe_api, owner):
    standin, settings = stripe_api
    payout = _requested(engine, owner)

    report = ps.send_pending(engine, settings)

    assert report.settled == [payout["id"]] and report.failed == report.waiting == []
    [sent] = standin.transfer_requests()
    assert sent["headers"]["idempotency-key"] == _key(engine, payout["id"]) == sent["form"]["transfer_group"]
    assert sent["headers"]["stripe-version"] == "2026-10-28.endive"
    assert {k: sent["form"][k] for k in ("amount", "currency", "destination", "metadata[payout_id]")} == {
        "amount": "3975", "currency": "usd", "destination": CONNECTED, "metadata[payout_id]": str(payout["id"])}
    [transfer] = standin.transfers_by_id.values()
    settled = _payout(engine, payout["id"])
    assert settled["state"] == po.SETTLED and settled["reference"] == transfer["id"] and standin.transfers_created == 1
    assert books(engine, owner) == PAID_40, "$39.75 left through Stripe, the $0.25 fee to the platform"
    assert _events(engine, "PayoutSent") == _events(engine, "PayoutSettled") == 1
    _verified(engine)

    assert ps.send_pending(engine, settings).as_dict() == {"settled": [], "failed": [], "waiting": []}
    assert len(standin.transfer_requests()) == 1, "a settled payout is never sent again"


def test_a_lost_answer_is_retried_under_the_same_key_and_makes_one_transfer(engine, stripe_api, owner):
    """Stripe makes the transfer and its answer is lost on the way (and on the
    SDK's own retries): the payout stays requested with nothing moved; the next
    run asks again under the same key and gets that transfer."""
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    standin.transfer_fault = LOST_ANSWER

    first = ps.send_pending(engine, settings)

    assert [w["payout_id"] for w in first.waiting] == [payout["id"]] and first.settled == []
    assert standin.transfers_created == 1 and _payout(engine, payout["id"])["state"] == po.REQUESTED
    assert books(engine, owner) == REQUESTED_40, "nothing moved while the answer is unknown"

    standin.transfer_fault = None
    assert ps.send_pending(engine, settings).settled == [payout["id"]]

    assert standin.transfers_created == 1, "one transfer, however many attempts"
    assert {r["headers"]["idempotency-key"] for r in standin.transfer_requests()} == {_key(engine, payout["id"])}
    assert len(standin.transfer_requests()) >= 2, "the lost attempt(s), then the one that got the answer"
    assert _payout(engine, payout["id"])["reference"] == next(iter(standin.transfers_by_id))
    assert books(engine, owner) == PAID_40 and _events(engine, "PayoutSettled") == 1
    _verified(engine)


def test_a_transfer_made_before_stripe_forgot_its_key_is_found_not_made_again(engine, stripe_api, owner):
    """Stripe forgets a key after 24 h: a payout older than that is looked up by its transfer group first."""
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    standin.transfer_fault = LOST_ANSWER
    ps.send_pending(engine, settings)
    standin.transfer_fault = None
    standin.expire_idempotency_keys()

    a_day_later = payout["requested_at"] + timedelta(hours=25)
    assert ps.send_pending(engine, settings, now=a_day_later).settled == [payout["id"]]

    assert standin.transfers_created == 1
    assert books(engine, owner) == PAID_40
    _verified(engine)


def test_two_senders_at_once_make_one_transfer(engine, stripe_api, owner):
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    start, reports = threading.Barrier(SENDERS), []

    def sender() -> None:
        start.wait()
        reports.append(ps.send_pending(engine, settings))

    threads = [threading.Thread(target=sender) for _ in range(SENDERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(reports) == SENDERS and sum(len(r.settled) for r in reports) == 1
    assert standin.transfers_created == 1 and _events(engine, "PayoutSettled") == 1
    assert {r["headers"]["idempotency-key"] for r in standin.transfer_requests()} == {_key(engine, payout["id"])}
    assert books(engine, owner) == PAID_40
    _verified(engine)


def test_stripe_refusing_the_transfer_fails_the_payout_back_to_earnings(engine, stripe_api, owner):
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    standin.missing_accounts.add(CONNECTED)

    report = ps.send_pending(engine, settings)

    assert [f["payout_id"] for f in report.failed] == [payout["id"]] and "No such destination" in report.failed[0]["reason"]
    failed = _payout(engine, payout["id"])
    assert failed["state"] == po.FAILED and "No such destination" in failed["failure_reason"]
    assert standin.transfers_created == 0 and books(engine, owner) == UNTOUCHED, "every nano-dollar back to earnings"
    _verified(engine)


def test_a_fee_not_in_whole_cents_fails_the_payout_before_stripe_is_asked(engine, stripe_api, owner):
    """PARALON_PAYOUT_FEE_STRIPE_USD of a tenth of a cent: no transfer pays exactly the amount less the fee."""
    standin, settings = stripe_api
    rules = po.PayoutRules(min_nano_usd=10 * USD, fee_nano_usd={po.STRIPE: CENT // 10})
    payout = po.request_payout(engine, owner, po.STRIPE, 40 * USD, rules)

    assert [f["payout_id"] for f in ps.send_pending(engine, settings).failed] == [payout["id"]]
    assert standin.transfer_requests() == [] and books(engine, owner) == UNTOUCHED


@pytest.mark.parametrize("fault", [SERVER_ERROR, BALANCE_INSUFFICIENT])
def test_stripe_failing_leaves_the_payout_requested_with_nothing_moved(engine, stripe_api, owner, fault):
    """A 5xx, or a refusal for the platform's own reasons (its balance): tried again at the next run."""
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    standin.transfer_fault = fault

    report = ps.send_pending(engine, settings)

    assert [w["payout_id"] for w in report.waiting] == [payout["id"]] and report.failed == []
    assert _payout(engine, payout["id"])["state"] == po.REQUESTED and standin.transfers_created == 0
    assert books(engine, owner) == REQUESTED_40 and _events(engine, "PayoutSent") == 0

    standin.transfer_fault = None
    assert ps.send_pending(engine, settings).settled == [payout["id"]]
    assert standin.transfers_created == 1 and books(engine, owner) == PAID_40


def test_a_changed_connected_account_returns_the_unpaid_payout_and_is_not_paid_in_its_cooldown(engine, stripe_api, owner):
    """Changed after the payout was asked for: the payout goes back to earnings unpaid. One asked
    for as if the cooldown were over is not paid while the sender's clock says it is not."""
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    with engine.begin() as conn:
        changed, _ = po.set_destination(conn, owner, po.STRIPE, MOVED)
    assert _payout(engine, payout["id"])["state"] == po.FAILED and books(engine, owner) == UNTOUCHED
    assert ps.send_pending(engine, settings).settled == [] and standin.transfer_requests() == []

    early = po.request_payout(engine, owner, po.STRIPE, 40 * USD, RULES, now=changed.usable_from)
    report = ps.send_pending(engine, settings, now=changed.usable_from - timedelta(seconds=1))

    assert [w["payout_id"] for w in report.waiting] == [early["id"]] and "cooldown" in report.waiting[0]["reason"]
    assert standin.transfer_requests() == [] and books(engine, owner) == REQUESTED_40
    assert ps.send_pending(engine, settings, now=changed.usable_from).settled == [early["id"]], "paid once the cooldown ends"


def test_a_retry_pays_one_requested_payout_and_refuses_any_other(engine, stripe_api, owner):
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    standin.transfer_fault = SERVER_ERROR
    ps.send_pending(engine, settings)
    standin.transfer_fault = None

    assert ps.retry(engine, settings, payout["id"]).settled == [payout["id"]]
    with pytest.raises(ps.NotPayable):
        ps.retry(engine, settings, payout["id"])
    assert standin.transfers_created == 1 and books(engine, owner) == PAID_40


def test_beat_pays_stripe_payouts_and_is_skipped_without_stripe(engine, database_url, stripe_api, owner, monkeypatch):
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    monkeypatch.setitem(celery.conf, "task_always_eager", True)
    monkeypatch.setenv("PARALON_DATABASE_URL", database_url)
    monkeypatch.delenv("PARALON_STRIPE_SECRET_KEY", raising=False)
    task = celery.tasks[PAYOUTS_SEND_STRIPE]
    assert celery.conf.beat_schedule["stripe-payouts"]["task"] == PAYOUTS_SEND_STRIPE

    assert "PARALON_STRIPE_SECRET_KEY" in task.apply(throw=True).get()["skipped"]
    assert books(engine, owner) == REQUESTED_40

    monkeypatch.setenv("PARALON_STRIPE_SECRET_KEY", API_KEY)
    monkeypatch.setenv("PARALON_STRIPE_API_BASE", settings.api_base)
    assert task.apply(throw=True).get() == {"settled": [payout["id"]], "failed": [], "waiting": []}
    assert standin.transfers_created == 1 and books(engine, owner) == PAID_40


# --- Taken back: transfer.reversed ---------------------------------------------------


def test_only_a_settled_payout_is_taken_back_and_only_once(engine, stripe_api, owner):
    """payouts.reverse_settled, the step a reversed transfer takes."""
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    with engine.begin() as conn:
        assert po.reverse_settled(conn, payout["id"], "not settled yet") is None
    assert books(engine, owner) == REQUESTED_40
    ps.send_pending(engine, settings)
    with engine.begin() as conn:
        taken = po.reverse_settled(conn, payout["id"], "taken back")
        assert taken["state"] == po.FAILED and taken["failure_reason"] == "taken back"
        assert po.reverse_settled(conn, payout["id"], "taken back") is None
        assert po.fail(conn, payout["id"], "again") is None and po.settle(conn, payout["id"], "tr_again") is None
    assert books(engine, owner) == UNTOUCHED
    assert _events(engine, "EventReversed") == _events(engine, "PayoutFailed") == 1
    _verified(engine)


def _receive(engine, settings, payload: bytes) -> str | None:
    return receive_webhook(engine, settings, payload, signed(payload, SECRET))


def test_copies_of_a_reversal_and_two_events_for_it_return_the_payout_once(engine, stripe_api, owner):
    standin, settings = stripe_api
    settled = _paid(engine, standin, settings, owner)
    transfer = standin.reverse(settled["reference"])
    reversed_event = transfer_event("transfer.reversed", transfer)
    updated_event = transfer_event("transfer.updated", transfer)  # the same reversal, said twice

    event_id = _receive(engine, settings, reversed_event)
    assert _receive(engine, settings, reversed_event) is None, "a copy of an event is stored once"
    assert process_event(engine, settings, event_id).startswith(f"reversed payout {settled['id']}")
    assert process_event(engine, settings, _receive(engine, settings, updated_event)).startswith("nothing new")
    assert process_pending(engine, settings) == []

    assert books(engine, owner) == UNTOUCHED, "the whole $40 back to earnings, the fee back from the platform"
    assert _events(engine, "EventReversed") == _events(engine, "PayoutFailed") == 1
    after = _payout(engine, settled["id"])
    assert after["state"] == po.FAILED and "reversed" in after["failure_reason"]
    _verified(engine)


def test_a_reversed_transfer_returns_the_payout_through_the_webhook_endpoint_and_a_forged_one_moves_nothing(
        engine, database_url, stripe_api, owner):
    standin, settings = stripe_api
    settled = _paid(engine, standin, settings, owner)
    transfer = standin.reverse(settled["reference"])
    event = transfer_event("transfer.reversed", transfer)
    env = {"PARALON_STRIPE_SECRET_KEY": API_KEY, "PARALON_STRIPE_WEBHOOK_SECRET": SECRET, "PARALON_STRIPE_API_BASE": settings.api_base}
    with serving(database_url, **env) as proxy:
        forged = event.replace(str(transfer["amount"]).encode(), b"999999")
        for payload, signature in ((event, None), (event, signed(event, "whsec_someone_else")), (forged, signed(event, SECRET))):
            refused = _deliver(proxy, payload, signature)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "bad_signature"
        assert books(engine, owner) == PAID_40 and _stored_events(engine) == 0, "nothing stored, nothing moved"

        for _ in range(2):
            assert _deliver(proxy, event, signed(event, SECRET)).status_code == 200
        wait_for(lambda: _payout(engine, settled["id"])["state"] == po.FAILED)
        wait_for(lambda: _processed_events(engine) == 1)

    assert books(engine, owner) == UNTOUCHED and _events(engine, "PayoutFailed") == 1
    _verified(engine)


def _stored_events(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(stripe_events)).scalar()


def _processed_events(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(stripe_events).where(stripe_events.c.processed_at.is_not(None))).scalar()


def test_a_reversal_before_the_transfer_is_recorded_waits_for_it(engine, stripe_api, owner):
    """The transfer was made, its answer lost, and Stripe reversed it before the
    next run: the event is parked with nothing moved, the next run settles the
    payout, and the event's retry returns it."""
    standin, settings = stripe_api
    payout = _requested(engine, owner)
    standin.transfer_fault = LOST_ANSWER
    ps.send_pending(engine, settings)
    standin.transfer_fault = None
    [transfer_id] = standin.transfers_by_id
    event_id = _receive(engine, settings, transfer_event("transfer.reversed", standin.reverse(transfer_id)))

    assert process_event(engine, settings, event_id).startswith("parked")
    assert books(engine, owner) == REQUESTED_40

    assert ps.send_pending(engine, settings).settled == [payout["id"]]
    later = _payout(engine, payout["id"])["sent_at"] + timedelta(days=1)
    [(_, outcome)] = process_pending(engine, settings, parked_only=True, now=later)
    assert outcome.startswith(f"reversed payout {payout['id']}")
    assert books(engine, owner) == UNTOUCHED and standin.transfers_created == 1
    _verified(engine)


def test_a_partial_reversal_is_parked_and_returns_nothing(engine, stripe_api, owner):
    standin, settings = stripe_api
    settled = _paid(engine, standin, settings, owner)
    part = standin.reverse(settled["reference"], amount=1000)
    event_id = _receive(engine, settings, transfer_event("transfer.reversed", part))

    outcome = process_event(engine, settings, event_id)

    assert outcome.startswith("parked") and "reversed in part (1000 of 3975 cents)" in outcome
    assert books(engine, owner) == PAID_40 and _payout(engine, settled["id"])["state"] == po.SETTLED
    rest = standin.reverse(settled["reference"])
    assert process_event(engine, settings, _receive(engine, settings, transfer_event("transfer.reversed", rest))).startswith("reversed")
    assert books(engine, owner) == UNTOUCHED


def test_a_transfer_event_that_is_not_a_payout_or_not_reversed_moves_nothing(engine, stripe_api, owner):
    standin, settings = stripe_api
    settled = _paid(engine, standin, settings, owner)
    not_reversed = transfer_event("transfer.updated", standin.transfers_by_id[settled["reference"]])
    assert process_event(engine, settings, _receive(engine, settings, not_reversed)).startswith("ignored")
    foreign = standin.transfers_by_id[settled["reference"]] | {"id": "tr_not_ours"}
    standin.transfers_by_id["tr_not_ours"] = {**foreign, "metadata": {"payout_id": str(settled["id"])}, "amount_reversed": foreign["amount"]}
    assert process_event(engine, settings, _receive(engine, settings, transfer_event("transfer.reversed", foreign))).startswith("ignored")
    assert books(engine, owner) == PAID_40 and _payout(engine, settled["id"])["state"] == po.SETTLED


def test_paralon_payouts_send_pays_the_stripe_rail_and_retry_pays_one_now(database_url, engine, stripe_api, owner):
    """The operator's commands: `payouts send --once` runs every configured rail (here Stripe alone);
    `payouts retry` pays one requested payout at once, under the same key; a second send finds nothing to do."""
    from click.testing import CliRunner

    from app.cli import main

    standin, settings = stripe_api
    env = {"PARALON_DATABASE_URL": database_url, "PARALON_STRIPE_SECRET_KEY": API_KEY, "PARALON_STRIPE_API_BASE": settings.api_base}
    first = _requested(engine, owner)
    sent = CliRunner().invoke(main, ["payouts", "send", "--once", "--json"], env=env)
    assert sent.exit_code == 0, (sent.stdout, sent.stderr)
    assert json.loads(sent.stdout) == {po.STRIPE: {"settled": [first["id"]], "failed": [], "waiting": []}}

    second = po.request_payout(engine, owner, po.STRIPE, 20 * USD, RULES)
    retried = CliRunner().invoke(main, ["payouts", "retry", str(second["id"]), "--json"], env=env)
    assert retried.exit_code == 0, (retried.stdout, retried.stderr)
    assert json.loads(retried.stdout)["state"] == po.SETTLED
    assert standin.transfers_created == 2
    again = CliRunner().invoke(main, ["payouts", "send", "--once", "--json"], env=env)
    assert json.loads(again.stdout) == {po.STRIPE: {"settled": [], "failed": [], "waiting": []}}
    assert books(engine, owner)["owner"] == 40 * USD
    _verified(engine)


def test_ledger_verify_checks_settled_payouts_against_stripes_transfers(database_url, engine, stripe_api, owner):
    """`paralon ledger verify` finds each settled payout's transfer on Stripe for its cents and connected
    account; a transfer Stripe reversed without the ledger hearing of it fails verify, naming it."""
    from click.testing import CliRunner

    from app.cli import main

    standin, settings = stripe_api
    env = {"PARALON_DATABASE_URL": database_url, "PARALON_STRIPE_SECRET_KEY": API_KEY, "PARALON_STRIPE_API_BASE": settings.api_base}
    payout = _paid(engine, standin, settings, owner)
    ok = CliRunner().invoke(main, ["ledger", "verify", "--json"], env=env)
    assert ok.exit_code == 0, (ok.stdout, ok.stderr)
    assert "Stripe payouts checked on Stripe: 1" in json.loads(ok.stdout)["payout_notes"]

    standin.reverse(payout["reference"])  # no webhook reaches the ledger
    failed = CliRunner().invoke(main, ["ledger", "verify", "--json"], env=env)
    assert failed.exit_code == 1
    assert any(f"payout {payout['id']}: Stripe's transfer {payout['reference']}" in p and "(reversed)" in p
               for p in json.loads(failed.stdout)["problems"])
