"""Holds that outlive nothing: spend limits reserved like balances, renewals
that record delivered usage, and the sweeper that settles at that usage.
Shared suite: SQLite and PostgreSQL."""
from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select, text

from ledger import commands as cmd
from ledger import spend_limits
from ledger.errors import IdempotencyConflict, InsufficientFunds, SpendLimitReached, UnknownAccount, WrongAccountKind
from ledger.holds import HoldRenewal, PlaceHold, expire_holds, expired_captures, place_holds, renew_holds, settlement_key
from ledger.schema import holds, utc_now
from ledger.service import Ledger, settle_orphaned_holds, sweep_expired_holds
from ledger.verify import verify
from tests.ledger.helpers import customer_with, key, money_snapshot
from tests.support.harness import wait_for

USD = 1_000_000_000
LIMIT_ID = 77


def _limited_customer(ledger, engine, credits_nano_usd: int, limit_nano_usd: int) -> int:
    customer = customer_with(ledger, credits_nano_usd)
    with engine.begin() as conn:
        spend_limits.create_limit(conn, LIMIT_ID, limit_nano_usd)
    return customer


def _limited_customer_in(engine, credits_nano_usd: int, limit_nano_usd: int) -> int:
    ledger = Ledger(engine)
    try:
        return _limited_customer(ledger, engine, credits_nano_usd, limit_nano_usd)
    finally:
        ledger.close()


def _limit(engine) -> dict:
    with engine.connect() as conn:
        return spend_limits.read_limits(conn, [LIMIT_ID])[LIMIT_ID]


def _every_hold_expired(engine) -> bool:
    with engine.connect() as conn:
        return conn.execute(select(func.max(holds.c.expires_at))).scalar() < utc_now()


def _settle(ledger, owner, hold, charge, request_id=None):
    request_id = request_id or key("req")
    return ledger.append(cmd.SettleRequest(hold.hold_id, owner, charge, request_id, settlement_key(request_id)))


def test_a_spend_limit_is_held_and_spent_like_a_balance(ledger, engine):
    customer = _limited_customer(ledger, engine, 10 * USD, 5 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    first = ledger.place_hold(PlaceHold(customer, 3 * USD, key("hold"), spend_limit_id=LIMIT_ID))
    clamped = ledger.place_hold(PlaceHold(customer, 4 * USD, key("hold"), minimum_nano_usd=USD, spend_limit_id=LIMIT_ID))
    assert clamped.amount_nano_usd == 2 * USD, "granted what the limit has left, not what the balance has"
    assert _limit(engine) == {"limit_nano_usd": 5 * USD, "spent_nano_usd": 0, "held_nano_usd": 5 * USD, "available_nano_usd": 0}
    before = money_snapshot(engine)
    with pytest.raises(SpendLimitReached):
        ledger.place_hold(PlaceHold(customer, 1, key("hold"), spend_limit_id=LIMIT_ID))
    assert money_snapshot(engine) == before, "a refused hold writes nothing"
    assert ledger.place_hold(PlaceHold(customer, USD, key("hold"))).amount_nano_usd == USD, "holds without the limit are not bound by it"
    _settle(ledger, owner, first, 2 * USD)
    ledger.release_hold(clamped.hold_id)
    assert _limit(engine) == {"limit_nano_usd": 5 * USD, "spent_nano_usd": 2 * USD, "held_nano_usd": 0, "available_nano_usd": 3 * USD}
    assert ledger.balance(customer).balance_nano_usd == 8 * USD
    with engine.connect() as conn:
        assert verify(conn).ok


def test_one_batch_of_holds_never_overshoots_a_limit(engine):
    customer = _limited_customer_in(engine, 100 * USD, 10 * USD)
    requests = [PlaceHold(customer, 3 * USD, key("hold"), minimum_nano_usd=USD, spend_limit_id=LIMIT_ID) for _ in range(10)]
    with engine.begin() as conn:
        results = place_holds(conn, requests)
    granted = [r.amount_nano_usd for r in results if not isinstance(r, Exception)]
    assert granted == [3 * USD, 3 * USD, 3 * USD, USD]
    assert all(isinstance(r, SpendLimitReached) for r in results[4:])
    assert _limit(engine)["held_nano_usd"] == 10 * USD


def test_a_batch_naming_an_unknown_or_non_customer_account_or_an_unknown_limit_refuses_only_those(ledger, engine):
    """Every other request of each batch fits: each refusal is its own, and
    nothing is held for it, even where the account named has money."""
    customer = customer_with(ledger, 10 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    _settle(ledger, owner, ledger.place_hold(PlaceHold(customer, 5 * USD, key("hold"))), 5 * USD)  # the owner earns 4 USD
    before = money_snapshot(engine)
    strangers = ((PlaceHold(10**12, USD, key("hold")), UnknownAccount), (PlaceHold(owner, USD, key("hold")), WrongAccountKind),
                 (PlaceHold(customer, USD, key("hold"), spend_limit_id=LIMIT_ID), SpendLimitReached))  # no such limit
    for stranger, refusal in strangers:
        with engine.begin() as conn:
            results = place_holds(conn, [PlaceHold(customer, USD, key("hold")), stranger])
        assert isinstance(results[1], refusal)
        assert results[0].amount_nano_usd == USD
    assert money_snapshot(engine) == {**before, "active_holds": 3}, "only the customer's three holds were placed"
    assert ledger.balance(customer).held_nano_usd == 3 * USD


def test_the_balance_still_binds_a_hold_under_a_generous_limit(ledger, engine):
    customer = _limited_customer(ledger, engine, USD, 50 * USD)
    with pytest.raises(InsufficientFunds):
        ledger.place_hold(PlaceHold(customer, 2 * USD, key("hold"), spend_limit_id=LIMIT_ID))
    assert _limit(engine)["held_nano_usd"] == 0


def test_a_renewed_hold_outlives_its_first_expiry_and_records_what_was_delivered(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    hold = ledger.place_hold(PlaceHold(customer, 2 * USD, key("hold"), ttl_s=10))
    meta = {"model": "m", "completion_tokens": 7}
    with engine.begin() as conn:
        assert renew_holds(conn, [HoldRenewal(hold.hold_id, 60, USD, owner, "req-1", meta)]) == {hold.hold_id}
        renew_holds(conn, [HoldRenewal(hold.hold_id, 60, USD // 2, owner, "req-1", meta)])  # never lowered
        assert renew_holds(conn, [HoldRenewal(987654, 60)]) == set(), "a closed hold is reported gone"
    with engine.begin() as conn:
        assert expire_holds(conn, now=utc_now() + timedelta(seconds=30)) == 0, "renewed past the old expiry"
        row = conn.execute(select(holds).where(holds.c.id == hold.hold_id)).one()
    assert (row.capture_nano_usd, row.capture_owner_account_id, row.capture_request_id) == (USD, owner, "req-1")
    with engine.begin() as conn:
        renew_holds(conn, [HoldRenewal(hold.hold_id, 60, 5 * USD, owner, "req-1", meta)])
        assert conn.execute(select(holds.c.capture_nano_usd).where(holds.c.id == hold.hold_id)).scalar() == 2 * USD, \
            "never above the hold"


def test_the_sweeper_settles_an_expired_hold_at_its_recorded_usage_and_releases_an_untouched_one(ledger, engine):
    customer = _limited_customer(ledger, engine, 10 * USD, 8 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    delivered = ledger.place_hold(PlaceHold(customer, 2 * USD, key("hold"), ttl_s=1, spend_limit_id=LIMIT_ID))
    ledger.place_hold(PlaceHold(customer, 3 * USD, key("hold"), ttl_s=1, spend_limit_id=LIMIT_ID))  # left untouched
    capture = 1_234_567_891
    with engine.begin() as conn:
        renew_holds(conn, [HoldRenewal(delivered.hold_id, 1, capture, owner, "req-crashed", {"completion_tokens": 9})])
    with engine.connect() as conn:
        assert expired_captures(conn, now=utc_now()) == [], "nothing is due before the expiry"
    wait_for(lambda: _every_hold_expired(engine), timeout_s=5)
    swept = sweep_expired_holds(engine)
    assert (swept.released, swept.settled) == (1, 1)
    assert sweep_expired_holds(engine) == (0, 0), "once"
    customer_view, owner_view = ledger.balance(customer), ledger.balance(owner)
    assert (customer_view.balance_nano_usd, customer_view.held_nano_usd) == (10 * USD - capture, 0)
    assert owner_view.balance_nano_usd == capture * 80 // 100
    assert _limit(engine) == {"limit_nano_usd": 8 * USD, "spent_nano_usd": capture, "held_nano_usd": 0,
                              "available_nano_usd": 8 * USD - capture}
    # The request's own settlement, arriving late with the full charge, finds its key taken: it must charge the rest.
    with pytest.raises(IdempotencyConflict):
        ledger.append(cmd.SettleRequest(delivered.hold_id, owner, capture + 1, "req-crashed", settlement_key("req-crashed")))
    with engine.connect() as conn:
        assert verify(conn).ok


def test_a_renewal_whose_usage_record_is_invalid_still_renews_its_hold(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    hold = ledger.place_hold(PlaceHold(customer, 2 * USD, key("hold"), ttl_s=10))
    good = ledger.place_hold(PlaceHold(customer, 2 * USD, key("hold"), ttl_s=10))
    with engine.begin() as conn:
        renewed = renew_holds(conn, [HoldRenewal(hold.hold_id, 60, USD, owner, "req-bad", {"ratio": 0.5}),  # not an integer
                                     HoldRenewal(good.hold_id, 60, USD, owner, "req-good", {"completion_tokens": 3})])
    assert renewed == {hold.hold_id, good.hold_id}, "one bad record loses neither hold"
    with engine.begin() as conn:
        assert expire_holds(conn, now=utc_now() + timedelta(seconds=30)) == 0
        captures = dict(conn.execute(select(holds.c.id, holds.c.capture_nano_usd)).all())
    assert captures == {hold.hold_id: 0, good.hold_id: USD}


def test_a_restarted_replica_settles_the_holds_it_left_at_once_and_no_one_elses(ledger, engine):
    """Given holds a crashed replica left (one that delivered, one untouched, one
    still renewed by a live process under the same id) and one of another
    replica, long before any expires: settling the orphans charges the
    recorded usage, releases the untouched one, and leaves the renewed hold and
    the other replica's alone."""
    customer = _limited_customer(ledger, engine, 10 * USD, 8 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")

    def place(name, replica):
        return ledger.place_hold(PlaceHold(customer, USD, key(name), ttl_s=600, spend_limit_id=LIMIT_ID, replica_id=replica))

    delivered, untouched, renewed = place("delivered", "host:8000"), place("untouched", "host:8000"), place("renewed", "host:8000")
    others = place("other", "host:8001")
    capture = 123_456_789
    with engine.begin() as conn:
        renew_holds(conn, [HoldRenewal(delivered.hold_id, 600, capture, owner, "req-crashed", {"completion_tokens": 3})])
    seen = ledger.holds_of_replica("host:8000")
    assert set(seen) == {delivered.hold_id, untouched.hold_id, renewed.hold_id}
    with engine.begin() as conn:  # the live twin renews its hold after the restart read it
        renew_holds(conn, [HoldRenewal(renewed.hold_id, 900)])
    assert settle_orphaned_holds(engine, seen) == (1, 1)
    assert settle_orphaned_holds(engine, seen) == (0, 0), "once"
    with engine.connect() as conn:
        assert set(conn.execute(select(holds.c.id)).scalars()) == {renewed.hold_id, others.hold_id}
    customer_view = ledger.balance(customer)
    assert (customer_view.balance_nano_usd, customer_view.held_nano_usd) == (10 * USD - capture, 2 * USD)
    assert ledger.balance(owner).balance_nano_usd == capture * 80 // 100
    assert _limit(engine)["spent_nano_usd"] == capture and _limit(engine)["held_nano_usd"] == 2 * USD
    with engine.connect() as conn:
        assert verify(conn).ok


def test_renewals_rewrite_holds_in_place_and_the_sweeper_still_finds_the_expired(pg_engine):
    """No index by expiry and room on each page (migration 0032): a renewal, which a
    running request sends about once a second, is a heap-only update that writes no
    index entry. The sweeper, scanning what is in flight, still closes what expired."""
    ledger = Ledger(pg_engine)
    customer = customer_with(ledger, 20 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    placed = [ledger.place_hold(PlaceHold(customer, USD, key("hold"))) for _ in range(20)]
    with pg_engine.begin() as conn:
        renewed = renew_holds(conn, [HoldRenewal(h.hold_id, 30, 1_000, owner, f"req-{i}", {"model": "m"}) for i, h in enumerate(placed)])
        updated, in_place = conn.execute(text(
            "SELECT pg_stat_get_xact_tuples_updated(CAST('holds' AS regclass)), "
            "pg_stat_get_xact_tuples_hot_updated(CAST('holds' AS regclass))")).one()
    assert renewed == {h.hold_id for h in placed}
    assert (updated, in_place) == (20, 20)
    before = money_snapshot(pg_engine)
    with pg_engine.begin() as conn:
        released = expire_holds(conn, now=utc_now() + timedelta(seconds=60))
        captures = expired_captures(conn, now=utc_now() + timedelta(seconds=60))
    assert released == 0 and sorted(c.hold_id for c in captures) == sorted(h.hold_id for h in placed), "each delivered something"
    assert money_snapshot(pg_engine) == before
    ledger.close()


def test_a_placed_hold_is_told_the_expiry_its_row_keeps(ledger, engine):
    """Created or found again, the answer's expiry is the stored one, to the microsecond."""
    customer = customer_with(ledger, USD)
    request = PlaceHold(customer, USD // 10, key("hold"), ttl_s=37)
    before = utc_now()
    created = ledger.place_hold(request)
    again = ledger.place_hold(request)
    with engine.connect() as conn:
        stored = conn.execute(select(holds.c.expires_at).where(holds.c.id == created.hold_id)).scalar_one()
    assert (created.status, again.status) == ("created", "exists")
    assert created.expires_at == again.expires_at == stored
    assert before + timedelta(seconds=37) <= stored <= utc_now() + timedelta(seconds=37)
