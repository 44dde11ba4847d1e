"""Payouts in the ledger, rail by rail's common steps: earnings set aside when
asked, sent, settled (the fee to the platform) or failed back to earnings;
refused with nothing moved when below the minimum, above the earnings, to no
destination or a cooling-down one, or while another is in flight on the rail;
each step taken once however often it is asked."""
from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from click.testing import CliRunner
from sqlalchemy import select, update

from app.cli import main
from app.payments import payouts as po
from app.payments.schema import payouts
from invoices import reconciliation, statements
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.errors import InsufficientFunds, InvalidInput, WrongAccountKind
from ledger.schema import accounts, utc_now
from ledger.service import append_now
from ledger.verify import verify

USD = 10**9
ADDRESS = "0x00000000000000000000000000000000000000a1"
OTHER_ADDRESS = "0x00000000000000000000000000000000000000b2"
CONNECTED = "acct_1PayoutTest"
FEE_NANO_USD = USD // 4
RULES = po.PayoutRules(min_nano_usd=10 * USD, fee_nano_usd={po.USDC: FEE_NANO_USD, po.STRIPE: 0})
CONCURRENT_REQUESTS = 50


@pytest.fixture
def owner(engine) -> int:
    """An owner with $100 of earnings and a destination on each rail."""
    with engine.begin() as conn:
        owner_id = acc.create_account(conn, cmd.OWNER, "gpu owner")
        po.set_destination(conn, owner_id, po.USDC, ADDRESS)
        po.set_destination(conn, owner_id, po.STRIPE, CONNECTED)
    append_now(engine, cmd.AdjustBalance(owner_id, 100 * USD, "earnings for the test", f"earn:{owner_id}"))
    return owner_id


def money(engine, owner_id: int) -> dict[str, int]:
    """The owner's earnings and every payout account's balance."""
    with engine.connect() as conn:
        codes = dict(conn.execute(select(accounts.c.system_code, accounts.c.id).where(accounts.c.system_code.is_not(None))).all())
    wanted = {"owner": owner_id, "revenue": codes[cmd.PLATFORM_REVENUE_ACCOUNT]}
    for rail in cmd.PAYOUT_RAILS:
        wanted[f"in_flight:{rail}"] = codes[cmd.payouts_in_flight_account(rail)]
        wanted[f"paid:{rail}"] = codes[cmd.payouts_paid_account(rail)]
    with engine.connect() as conn:
        books = acc.read_books(conn, list(wanted.values()))
    return {name: books[account_id].balance_nano_usd for name, account_id in wanted.items()}


def test_a_payout_is_set_aside_sent_and_settled_with_its_fee_to_the_platform(engine, owner):
    before = money(engine, owner)
    payout = po.request_payout(engine, owner, po.USDC, 40 * USD, RULES)
    assert payout["state"] == po.REQUESTED and payout["amount_nano_usd"] == 40 * USD and payout["fee_nano_usd"] == FEE_NANO_USD
    assert money(engine, owner) == {**before, "owner": 60 * USD, "in_flight:usdc": 40 * USD}

    with engine.begin() as conn:
        assert po.record_sent(conn, payout["id"], "0xabc", {"nonce": 7})["state"] == po.SENT
        settled = po.settle(conn, payout["id"], "0xabc")
    assert settled["state"] == po.SETTLED and settled["closed_seq"] > settled["requested_seq"]
    assert money(engine, owner) == {**before, "owner": 60 * USD, "paid:usdc": 40 * USD - FEE_NANO_USD,
                                    "revenue": before["revenue"] + FEE_NANO_USD}
    with engine.connect() as conn:
        assert verify(conn).ok


def test_a_failed_payout_returns_every_nano_dollar_to_earnings(engine, owner):
    before = money(engine, owner)
    payout = po.request_payout(engine, owner, po.USDC, 40 * USD, RULES)
    with engine.begin() as conn:
        po.record_sent(conn, payout["id"], "0xabc")
        assert po.fail(conn, payout["id"], "dropped by the chain")["state"] == po.FAILED
    assert money(engine, owner) == before


def test_each_step_is_taken_once_however_often_it_is_asked(engine, owner):
    payout = po.request_payout(engine, owner, po.STRIPE, 40 * USD, RULES)
    with engine.begin() as conn:
        po.record_sent(conn, payout["id"], "tr_1")
        assert po.settle(conn, payout["id"], "tr_1") is not None
    after = money(engine, owner)
    with engine.begin() as conn:
        assert po.settle(conn, payout["id"], "tr_1") is None
        assert po.fail(conn, payout["id"], "late failure") is None
        assert po.record_sent(conn, payout["id"], "tr_2") is None
    assert money(engine, owner) == after
    assert po.request_payout(engine, owner, po.STRIPE, 10 * USD, RULES)["state"] == po.REQUESTED, "the rail is free again"


def test_an_amount_is_rounded_down_to_the_rails_unit_and_the_remainder_stays(engine, owner):
    asked = 12 * USD + 345_678_912  # $12.345678912
    usdc = po.request_payout(engine, owner, po.USDC, asked, RULES)
    stripe = po.request_payout(engine, owner, po.STRIPE, asked, RULES)
    assert usdc["amount_nano_usd"] == 12_345_678_000  # whole micro-USDC
    assert stripe["amount_nano_usd"] == 12_340_000_000  # whole cents
    assert money(engine, owner)["owner"] == 100 * USD - 12_345_678_000 - 12_340_000_000


@pytest.mark.parametrize("case", ["below_minimum", "above_earnings", "in_flight", "no_destination", "cooling_down", "customer"])
def test_a_refused_payout_moves_nothing_and_writes_nothing(engine, owner, case):
    account, rail, amount = owner, po.USDC, 20 * USD
    if case == "in_flight":
        po.request_payout(engine, owner, po.USDC, 20 * USD, RULES)
    before = money(engine, owner)
    with engine.begin() as conn:
        if case == "no_destination":
            account = acc.create_account(conn, cmd.OWNER, "owner without a destination")
        elif case == "customer":
            account = acc.create_account(conn, cmd.CUSTOMER, "a customer")
        elif case == "cooling_down":
            po.set_destination(conn, owner, po.USDC, OTHER_ADDRESS)
        payouts_before = len(po.list_payouts(conn, account))
    amount = {"below_minimum": 10 * USD - 1, "above_earnings": 100 * USD + 1_000}.get(case, amount)
    expected = {"in_flight": po.PayoutInFlight, "no_destination": po.NoDestination, "cooling_down": po.DestinationCoolingDown,
                "customer": WrongAccountKind, "above_earnings": InsufficientFunds}.get(case, InvalidInput)

    with pytest.raises(expected):
        po.request_payout(engine, account, rail, amount, RULES)

    assert money(engine, owner) == before
    with engine.connect() as conn:
        assert len(po.list_payouts(conn, account)) == payouts_before


def test_a_changed_destination_is_paid_only_after_the_cooldown(engine, owner):
    with engine.begin() as conn:
        changed, was_changed = po.set_destination(conn, owner, po.USDC, OTHER_ADDRESS)
        again, changed_again = po.set_destination(conn, owner, po.USDC, OTHER_ADDRESS.upper().replace("0X", "0x"))
    assert was_changed and not changed_again and again == changed
    assert changed.previous_destination == "0x00000000000000000000000000000000000000A1"
    assert changed.usable_from - changed.changed_at == timedelta(days=1)
    with pytest.raises(po.DestinationCoolingDown):
        po.request_payout(engine, owner, po.USDC, 20 * USD, RULES, now=changed.usable_from - timedelta(seconds=1))
    payout = po.request_payout(engine, owner, po.USDC, 20 * USD, RULES, now=changed.usable_from)
    assert payout["destination"] == changed.destination


@pytest.mark.parametrize("destination", ["0x12", "not an address", "0x" + "0" * 40, "acct_ok"])
def test_a_usdc_destination_must_be_an_address(engine, owner, destination):
    with engine.begin() as conn, pytest.raises(InvalidInput):
        po.set_destination(conn, owner, po.USDC, destination)


def test_50_concurrent_requests_for_more_than_the_earnings_pay_at_most_the_earnings(engine, owner):
    """Each asks for $60 of $100 on one of the two rails: one wins; the rest are
    refused as in flight on that rail or as above what is left."""
    before = money(engine, owner)
    outcomes, start = [], threading.Barrier(CONCURRENT_REQUESTS)

    def ask(i: int) -> None:
        start.wait()
        try:
            outcomes.append(po.request_payout(engine, owner, cmd.PAYOUT_RAILS[i % 2], 60 * USD, RULES)["id"])
        except (po.PayoutInFlight, InsufficientFunds) as exc:
            outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(CONCURRENT_REQUESTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    granted = [o for o in outcomes if isinstance(o, int)]
    assert len(outcomes) == CONCURRENT_REQUESTS and len(granted) == 1
    after = money(engine, owner)
    assert after["owner"] == before["owner"] - 60 * USD >= 0
    assert after["in_flight:usdc"] + after["in_flight:stripe"] == 60 * USD
    with engine.connect() as conn:
        assert verify(conn).ok


def test_an_in_flight_account_cannot_pay_out_what_was_never_requested(engine, owner):
    """The ledger's own guard, below the payouts table: settling a payout that was never set aside is refused."""
    with pytest.raises(InsufficientFunds):
        append_now(engine, cmd.SettlePayout(999, owner, po.USDC, 5 * USD, 0, "0xforged", "payout:999:settled"))
    assert money(engine, owner)["paid:usdc"] == 0


def test_an_owners_statement_and_reconciliation_show_its_payouts(engine, owner):
    """Requested, returned and settled payouts are sections of the owner's month, which still balances."""
    returned = po.request_payout(engine, owner, po.USDC, 30 * USD, RULES)
    with engine.begin() as conn:
        po.fail(conn, returned["id"], "the destination refused it")
    paid = po.request_payout(engine, owner, po.STRIPE, 20 * USD, RULES)
    with engine.begin() as conn:
        po.record_sent(conn, paid["id"], "tr_1")
        po.settle(conn, paid["id"], "tr_1")
    now = utc_now()
    month = statements.parse_month(now.strftime("%Y-%m"))
    after = statements.parse_month((month.end + timedelta(days=1)).strftime("%Y-%m"))

    figures = reconciliation.reconcile(engine, owner, month, after, now)

    assert figures["balanced"], figures["problems"]
    assert figures["payouts_nano_usd"] == -50 * USD and figures["payouts_returned_nano_usd"] == 30 * USD
    assert figures["closing_balance_nano_usd"] == 80 * USD
    with engine.connect() as conn:
        built = statements.build(conn, owner, month, statements.Labels({}, {}), now)
    sections = {s["title"]: s["amount_nano_usd"] for s in built["sections"]}
    assert sections["Payouts"] == -50 * USD and sections["Payouts returned"] == 30 * USD
    assert f"payout {returned['id']} (usdc): the destination refused it" in [line["reference"] for line in built["itemised"]]


def test_ledger_verify_proves_the_payouts_table_against_the_ledger(database_url, engine, owner):
    """`paralon ledger verify` is ok with payouts in every state, and fails when a row is
    edited behind the ledger's back: a changed amount, a state no event moved it to."""
    settled = po.request_payout(engine, owner, po.STRIPE, 20 * USD, RULES)
    with engine.begin() as conn:
        po.record_sent(conn, settled["id"], "tr_1")
        po.settle(conn, settled["id"], "tr_1")
    in_flight = po.request_payout(engine, owner, po.USDC, 30 * USD, RULES)
    verify_cli = ["ledger", "verify", "--json"]
    assert _paralon(database_url, *verify_cli)["ok"] is True

    with engine.begin() as conn:
        conn.execute(update(payouts).where(payouts.c.id == settled["id"]).values(amount_nano_usd=21 * USD))
        conn.execute(update(payouts).where(payouts.c.id == in_flight["id"]).values(state=po.FAILED))
    report = _paralon(database_url, *verify_cli, exit_code=1)

    assert report["ok"] is False
    assert any(f"payout {settled['id']}: event" in problem for problem in report["problems"])
    assert any("payouts in flight on usdc: the ledger holds 30000000000 nano-USD, the payouts in flight 0" in problem
               for problem in report["problems"])
    assert any(f"payout {in_flight['id']} (failed) names event None as its PayoutFailed" in p for p in report["problems"])


def _paralon(database_url: str, *args: str, exit_code: int = 0) -> dict:
    result = CliRunner().invoke(main, list(args), env={"PARALON_DATABASE_URL": database_url})
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def test_the_weekly_schedule_pays_each_owner_once_a_week_what_exceeds_the_minimum(engine, owner):
    monday = utc_now().replace(year=2030, month=12, day=2, hour=1)  # a Monday
    with engine.begin() as conn:
        po.set_weekly(conn, owner, po.USDC, True)
        poor = acc.create_account(conn, cmd.OWNER, "a new owner")
        po.set_destination(conn, poor, po.USDC, OTHER_ADDRESS, now=monday - timedelta(days=7))
        po.set_weekly(conn, poor, po.USDC, True)
    append_now(engine, cmd.AdjustBalance(owner, 345_678_912, "a part of a cent", "earn:more"))
    append_now(engine, cmd.AdjustBalance(poor, 9 * USD, "below the minimum", "earn:poor"))

    first = po.pay_weekly(engine, RULES, monday)
    again = po.pay_weekly(engine, RULES, monday.replace(hour=5))

    assert len(first["requested"]) == 1 and first["below_minimum"] == 1
    assert again == {"requested": [], "below_minimum": 1, "already_this_week": 1, "refused": 0}
    with engine.connect() as conn:
        [payout] = po.list_payouts(conn, owner)
    assert payout["amount_nano_usd"] == 100_345_678_000 and payout["rail"] == po.USDC
    assert money(engine, owner)["owner"] == 912, "what a micro-USDC cannot carry stays in earnings"
    assert po.pay_weekly(engine, RULES, monday + timedelta(days=7))["already_this_week"] == 1, "still in flight next week"


def test_a_failed_payout_is_retried_as_a_new_one_and_nothing_else_is(engine, owner):
    first = po.request_payout(engine, owner, po.USDC, 40 * USD, RULES)
    with pytest.raises(InvalidInput):
        po.retry_failed(engine, first["id"], RULES)
    with engine.begin() as conn:
        po.fail(conn, first["id"], "the chain dropped it")
    again = po.retry_failed(engine, first["id"], RULES)
    assert (again["amount_nano_usd"], again["rail"], again["state"]) == (40 * USD, po.USDC, po.REQUESTED)
    assert again["id"] != first["id"] and money(engine, owner)["owner"] == 60 * USD


def test_a_destination_change_returns_payouts_not_yet_sent_and_leaves_sent_ones(engine, owner):
    unsent = po.request_payout(engine, owner, po.USDC, 40 * USD, RULES)
    sent = po.request_payout(engine, owner, po.STRIPE, 20 * USD, RULES)
    with engine.begin() as conn:
        po.record_sent(conn, sent["id"], "tr_1")
        po.set_destination(conn, owner, po.USDC, OTHER_ADDRESS)
        po.set_destination(conn, owner, po.STRIPE, "acct_2Other")
        assert po.payout_row(conn, unsent["id"])["failure_reason"] == "the destination changed before it was sent"
        assert po.payout_row(conn, sent["id"])["state"] == po.SENT
    assert money(engine, owner)["owner"] == 80 * USD and money(engine, owner)["in_flight:usdc"] == 0


def test_a_changed_destination_is_mailed_to_the_owners_people(engine, owner):
    """Members and the account's address hear of it, with the old and new destination and when payouts go to it."""
    from aiosmtpd.controller import Controller

    from app.jobs.payout_mail import destination_changed
    from app.outbox import outbox
    from app.members import add_member
    from invoices.mail import MailSettings
    from tests.invoices.test_mail import Inbox
    from tests.support.harness import free_port

    with engine.begin() as conn:
        add_member(conn, owner, "ops@farm.example", "owner")
        changed, _ = po.set_destination(conn, owner, po.USDC, OTHER_ADDRESS)
    with engine.connect() as conn:  # written with the change, sent once it committed
        assert conn.execute(select(outbox.c.task, outbox.c.args)).all() == [(po.DESTINATION_CHANGED_TASK, f'[{owner},"usdc"]')]
    inbox, port = Inbox(), free_port()
    server = Controller(inbox, hostname="127.0.0.1", port=port)
    server.start()
    try:
        assert destination_changed(engine, MailSettings("127.0.0.1", port), owner, po.USDC) == 1
    finally:
        server.stop()
    [message] = inbox.messages
    body = message.get_content()
    assert message["To"] == "ops@farm.example" and "payout destination" in message["Subject"]
    for expected in (changed.destination, "0x00000000000000000000000000000000000000A1", changed.usable_from.strftime("%Y-%m-%d %H:%M")):
        assert expected in body, expected
