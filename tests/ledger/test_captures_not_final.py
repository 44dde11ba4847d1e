"""Captures that are not final: a settlement takes its charge from a hold and
leaves the rest of it open for the next (`SettleRequest.final_capture=False`),
as a proxy replica's requests share one pooled hold. Shared suite: SQLite and
PostgreSQL, postings as rows and in their event's row."""
from __future__ import annotations

import json
import threading

import pytest
from sqlalchemy import select

from ledger import commands as cmd
from ledger import spend_limits
from ledger import store
from ledger.accounts import create_system_account
from ledger.errors import HoldNotActive, IdempotencyConflict, InsufficientFunds
from ledger.holds import PlaceHold, expire_holds, settlement_key
from ledger.limits import EVENTS_INSERTED_WITH_COMMIT_MAX
from ledger.log import read_events
from ledger.schema import accounts, holds
from ledger.service import Ledger
from ledger.store import AppendResult
from ledger.verify import verify
from tests.ledger.helpers import customer_with, key, money_snapshot

USD = 1_000_000_000
LIMIT_ID = 78


def _capture(hold_id: int, owner: int, charge: int, request_id: str | None = None, final: bool = False) -> cmd.SettleRequest:
    request_id = request_id or key("req")
    return cmd.SettleRequest(hold_id, owner, charge, request_id, settlement_key(request_id), {"model": "m"}, final)


def _hold_left(engine, hold_id: int) -> int | None:
    with engine.connect() as conn:
        return conn.execute(select(holds.c.amount_nano_usd).where(holds.c.id == hold_id)).scalar()


def _in_one_batch(engine, commands: list) -> list:
    with engine.begin() as conn:
        return store.append_batch(conn, commands)


@pytest.fixture
def books(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    with engine.connect() as conn:
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == cmd.PLATFORM_REVENUE_ACCOUNT)).scalar_one()
    return customer, owner, platform


def test_captures_that_are_not_final_charge_each_and_leave_the_rest_held(ledger, engine, books):
    customer, owner, platform = books
    hold = ledger.place_hold(PlaceHold(customer, 4 * USD, key("pool")))
    for charge in (USD, 250_000_000):
        ledger.append(_capture(hold.hold_id, owner, charge))
    assert _hold_left(engine, hold.hold_id) == 4 * USD - 1_250_000_000
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd, view.available_nano_usd) == (
        10 * USD - 1_250_000_000, 4 * USD - 1_250_000_000, 6 * USD), "what is still held is still reserved"
    assert ledger.balance(owner).balance_nano_usd == 1_000_000_000, "80% of each charge to the owner"
    assert ledger.balance(platform).balance_nano_usd == 250_000_000
    assert ledger.release_hold(hold.hold_id)
    view = ledger.balance(customer)
    assert (view.held_nano_usd, view.available_nano_usd) == (0, 10 * USD - 1_250_000_000), "the release frees what was left"
    with engine.connect() as conn:
        assert verify(conn).ok


def test_a_capture_that_is_not_final_releases_nothing_in_its_event(ledger, engine, books):
    customer, owner, _ = books
    hold = ledger.place_hold(PlaceHold(customer, 4 * USD, key("pool")))
    seq = ledger.append(_capture(hold.hold_id, owner, USD)).seq
    with engine.connect() as conn:
        [event] = read_events(conn, seq - 1, 1)
    payload = json.loads(event.payload_json)
    assert (payload["charge_nano_usd"], payload["released_nano_usd"], payload["hold_id"]) == (USD, 0, hold.hold_id)


def test_captures_of_one_hold_in_one_batch_are_taken_together(ledger, engine, books):
    customer, owner, _ = books
    hold = ledger.place_hold(PlaceHold(customer, 4 * USD, key("pool")))
    results = _in_one_batch(engine, [_capture(hold.hold_id, owner, USD) for _ in range(3)])
    assert [r.status for r in results] == ["created"] * 3
    assert _hold_left(engine, hold.hold_id) == USD
    assert ledger.balance(customer).balance_nano_usd == 7 * USD


def test_captures_above_what_is_left_are_refused_and_move_nothing(ledger, engine, books):
    customer, owner, _ = books
    hold = ledger.place_hold(PlaceHold(customer, 2 * USD, key("pool")))
    before = money_snapshot(engine)
    results = _in_one_batch(engine, [_capture(hold.hold_id, owner, USD), _capture(hold.hold_id, owner, USD + 1)])
    assert all(isinstance(r, HoldNotActive) for r in results), results
    assert money_snapshot(engine) == before
    assert _hold_left(engine, hold.hold_id) == 2 * USD, "nothing was taken from the hold"


def test_a_capture_refused_under_the_append_lock_gives_its_charge_back_to_the_hold(ledger, engine, books):
    customer, owner, _ = books
    hold = ledger.place_hold(PlaceHold(customer, 4 * USD, key("pool")))
    with engine.begin() as conn:
        create_system_account(conn, "external:card", "Card payments")
    ledger.append(cmd.RefundCredits(customer, 9 * USD + 500_000_000, "card", "re_1", "external:card", key("refund")))  # 0.5 USD left
    before = money_snapshot(engine)
    results = _in_one_batch(engine, [_capture(hold.hold_id, owner, USD), _capture(hold.hold_id, owner, 200_000_000)])
    assert isinstance(results[0], InsufficientFunds)
    assert isinstance(results[1], AppendResult), "the capture the credits cover is written"
    assert _hold_left(engine, hold.hold_id) == 4 * USD - 200_000_000, "the refused capture's charge is held again"
    assert ledger.balance(customer).balance_nano_usd == 300_000_000
    assert money_snapshot(engine)["events"] == before["events"] + 1


def test_a_retried_capture_that_is_not_final_is_found_and_not_taken_again(ledger, engine, books):
    customer, owner, _ = books
    hold = ledger.place_hold(PlaceHold(customer, 4 * USD, key("pool")))
    command = _capture(hold.hold_id, owner, USD)
    first = ledger.append(command)
    again = ledger.append(command)
    assert (again.status, again.seq) == ("exists", first.seq)
    assert _hold_left(engine, hold.hold_id) == 3 * USD, "the retry's charge went back to the hold"
    assert ledger.balance(customer).balance_nano_usd == 9 * USD


def test_a_final_capture_in_the_same_batch_closes_the_hold_and_refuses_the_others(ledger, engine, books):
    customer, owner, _ = books
    hold = ledger.place_hold(PlaceHold(customer, 4 * USD, key("pool")))
    not_final = _capture(hold.hold_id, owner, USD)
    results = _in_one_batch(engine, [not_final, _capture(hold.hold_id, owner, 2 * USD, final=True)])
    assert isinstance(results[0], HoldNotActive) and isinstance(results[1], AppendResult)
    assert _hold_left(engine, hold.hold_id) is None
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (8 * USD, 0), "the final capture released the rest"
    assert isinstance(_in_one_batch(engine, [not_final])[0], HoldNotActive), "and the hold is gone for the next"


def test_captures_that_are_not_final_spend_a_limit_by_their_charges(ledger, engine, books):
    customer, owner, _ = books
    with engine.begin() as conn:
        spend_limits.create_limit(conn, LIMIT_ID, 5 * USD)
    hold = ledger.place_hold(PlaceHold(customer, 3 * USD, key("pool"), spend_limit_id=LIMIT_ID))
    _in_one_batch(engine, [_capture(hold.hold_id, owner, USD), _capture(hold.hold_id, owner, 400_000_000)])
    ledger.append(_capture(hold.hold_id, owner, 100_000_000))
    with engine.connect() as conn:
        limit = spend_limits.read_limits(conn, [LIMIT_ID])[LIMIT_ID]
    assert limit == {"limit_nano_usd": 5 * USD, "spent_nano_usd": 1_500_000_000, "held_nano_usd": 1_500_000_000,
                     "available_nano_usd": 2 * USD}
    ledger.release_hold(hold.hold_id)
    with engine.connect() as conn:
        assert spend_limits.read_limits(conn, [LIMIT_ID])[LIMIT_ID]["held_nano_usd"] == 0


def test_an_expired_pooled_hold_frees_what_its_captures_left(ledger, engine, books):
    customer, owner, _ = books
    hold = ledger.place_hold(PlaceHold(customer, 4 * USD, key("pool"), ttl_s=1))
    ledger.append(_capture(hold.hold_id, owner, USD))
    with engine.begin() as conn:
        assert expire_holds(conn, now=hold.expires_at.replace(year=hold.expires_at.year + 1)) == 1
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd, view.available_nano_usd) == (9 * USD, 0, 9 * USD)


def test_captures_racing_from_many_threads_never_take_more_than_the_hold(ledger, engine, books):
    """Through the group-commit writer, batches of any make-up (a batch whose
    captures from the hold add up to more than it has left gets none of
    them): what is written is exactly what was taken, and once the racing is
    over, captures one by one take exactly what is left, to the last nano-USD."""
    customer, owner, _ = books
    hold = ledger.place_hold(PlaceHold(customer, 3 * USD, key("pool")))
    charge = 100_000_000
    written: list[int] = []
    lock = threading.Lock()

    def settle() -> None:
        try:
            ledger.append(_capture(hold.hold_id, owner, charge))
        except HoldNotActive:
            return
        with lock:
            written.append(charge)

    threads = [threading.Thread(target=settle) for _ in range(40)]  # more than the hold holds in all
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(written) <= 3 * USD and _hold_left(engine, hold.hold_id) == 3 * USD - sum(written)
    while True:
        try:
            ledger.append(_capture(hold.hold_id, owner, charge))
        except HoldNotActive:
            break
        written.append(charge)
    assert sum(written) == 3 * USD and _hold_left(engine, hold.hold_id) == 0
    assert ledger.balance(customer).balance_nano_usd == 7 * USD
    with engine.connect() as conn:
        assert verify(conn).ok


def test_captures_may_take_all_a_hold_has_and_it_stays_open_holding_nothing(ledger, engine, books):
    customer, owner, _ = books
    hold = ledger.place_hold(PlaceHold(customer, 2 * USD, key("pool")))
    assert all(isinstance(r, AppendResult) for r in _in_one_batch(engine, [_capture(hold.hold_id, owner, USD) for _ in range(2)]))
    assert _hold_left(engine, hold.hold_id) == 0
    assert isinstance(_in_one_batch(engine, [_capture(hold.hold_id, owner, 1)])[0], HoldNotActive)
    assert ledger.release_hold(hold.hold_id)
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (8 * USD, 0)


@pytest.fixture
def pg_ledger(pg_engine):
    ledger = Ledger(pg_engine)
    yield ledger
    ledger.close()


@pytest.mark.parametrize("others", [1, EVENTS_INSERTED_WITH_COMMIT_MAX], ids=["inserted with the commit", "by copy"])
@pytest.mark.parametrize("retried", [True, False], ids=["its retry", "another event"])
def test_a_captures_key_in_the_log_is_refused_by_the_index_and_answered_on_the_run_again(pg_ledger, pg_engine, monkeypatch,
                                                                                        retried, others):
    """The writer does not look up the key of a capture that took from its
    hold (the proxy's own, sent again only when its answer was lost): the
    log's unique index refuses it, and the batch runs again looking every
    key up under the lock. The capture gets its `exists` (its retry) or its
    conflict (another event's key), its take goes back to the pooled hold,
    and the other captures of the batch are charged once."""
    customer = customer_with(pg_ledger, 10 * USD)
    owner = pg_ledger.create_account(cmd.OWNER, "gpu owner")
    hold = pg_ledger.place_hold(PlaceHold(customer, 4 * USD, key("pool")))
    repeated, fine = _capture(hold.hold_id, owner, USD), [_capture(hold.hold_id, owner, USD // 64) for _ in range(others)]
    first = pg_ledger.append(repeated if retried else cmd.GrantCredits(customer, 1, "takes the key", repeated.idempotency_key))
    lock_and_read, locks_taken = store._lock_and_read, []
    monkeypatch.setattr(store, "_lock_and_read", lambda conn, *args: locks_taken.append(conn) or lock_and_read(conn, *args))
    before, left = money_snapshot(pg_engine), _hold_left(pg_engine, hold.hold_id)
    futures = [pg_ledger.appender.submit(command) for command in (repeated, *fine)]
    if retried:
        assert (futures[0].result(timeout=30).status, futures[0].result().seq) == ("exists", first.seq)
    else:
        with pytest.raises(IdempotencyConflict):
            futures[0].result(timeout=30)
    assert all(f.result(timeout=30).status == "created" for f in futures[1:])
    assert len(locks_taken) == 2, "the batch refused by the index, not by a look-up, then run again"
    after = money_snapshot(pg_engine)
    assert after["events"] == before["events"] + others, "the other captures alone"
    assert after["balances"][customer] == before["balances"][customer] - others * (USD // 64)
    assert _hold_left(pg_engine, hold.hold_id) == left - others * (USD // 64), "the repeated capture's take went back"
    with pg_engine.connect() as conn:
        assert verify(conn).ok
