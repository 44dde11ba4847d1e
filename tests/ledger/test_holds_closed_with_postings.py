"""On PostgreSQL the holds a batch settles close in the same update of each
customer's balance row as its postings move it (migration 0035): the writer
announces them, the postings' trigger adds them, and nothing else may."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
from sqlalchemy import make_url, text
from sqlalchemy.exc import DBAPIError

from ledger import commands as cmd
from ledger.hold_commands import PlaceHold
from ledger.service import Ledger
from ledger.storage import postgres
from ledger.store import append_batch
from tests.ledger.helpers import customer_with, key, money_snapshot, postings_in_event_row

USD = 10**9
HOLD = USD // 10
CHARGE = USD // 40
_ROWS_UPDATED = "SELECT n_tup_upd FROM pg_stat_xact_user_tables WHERE relname = 'account_balances'"
_ANNOUNCE = ("SELECT set_config('paralon.holds_closed_account_ids', :ids, true), "
             "set_config('paralon.holds_closed_nano_usd', :amounts, true)")


@pytest.fixture
def pg_ledger(pg_engine):
    ledger = Ledger(pg_engine)
    yield ledger
    ledger.close()


def _held_and_available(ledger: Ledger, customer: int) -> tuple[int, int]:
    view = ledger.balance(customer)
    return view.held_nano_usd, view.available_nano_usd


def _settlements(ledger: Ledger, customers: list[int], owner: int, holds_each: int) -> list[cmd.SettleRequest]:
    settles = []
    for customer in customers:
        for _ in range(holds_each):
            hold = ledger.place_hold(PlaceHold(customer, HOLD, key("hold")))
            settles.append(cmd.SettleRequest(hold.hold_id, owner, CHARGE, key("req"), key("settle")))
    return settles


def test_each_balance_row_is_written_once_by_a_batch_of_settlements(pg_ledger, pg_engine):
    """Two customers, two settlements each, one owner and the platform: four
    rows moved, each updated once where postings are in their event's row
    (before 0035, each customer's row twice). As rows, the postings move the
    balances in a statement of their own, after the closes."""
    customers = [customer_with(pg_ledger, USD) for _ in range(2)]
    owner = pg_ledger.create_account(cmd.OWNER, "owner")
    settles = _settlements(pg_ledger, customers, owner, holds_each=2)
    with pg_engine.begin() as conn:
        before = conn.execute(text(_ROWS_UPDATED)).scalar_one()
        results = append_batch(conn, settles)
        updated = conn.execute(text(_ROWS_UPDATED)).scalar_one() - before
    assert all(r.status == "created" for r in results)
    assert updated == (4 if postings_in_event_row(pg_engine) else 6)
    for customer in customers:
        assert _held_and_available(pg_ledger, customer) == (0, USD - 2 * CHARGE)


def test_a_settlement_refused_under_the_lock_closes_nothing_and_the_rest_close_theirs(pg_ledger, pg_engine):
    """What the batch announced before the lock is corrected when one of its
    settlements is refused under it (here its key was used meanwhile)."""
    customer = customer_with(pg_ledger, USD)
    owner = pg_ledger.create_account(cmd.OWNER, "owner")
    kept, refused = _settlements(pg_ledger, [customer], owner, holds_each=2)
    with pg_engine.begin() as conn:
        used = append_batch(conn, [cmd.GrantCredits(customer, 1, "takes the key", refused.idempotency_key)])[0]
    with pg_engine.begin() as conn:
        results = append_batch(conn, [kept, refused])
    assert results[0].status == "created" and type(results[1]).__name__ == "IdempotencyConflict", results
    assert used.status == "created"
    assert _held_and_available(pg_ledger, customer) == (HOLD, USD + 1 - CHARGE - HOLD), "the refused one's hold is still held"
    retried = pg_ledger.append(cmd.SettleRequest(refused.hold_id, owner, CHARGE, refused.request_id, key("settle again")))
    assert retried.status == "created", "its hold's row was put back whole: a settlement with a key of its own closes it"
    assert _held_and_available(pg_ledger, customer) == (0, USD + 1 - 2 * CHARGE)


@pytest.mark.parametrize("settlements", [1, 20], ids=["alone", "in-a-batch"])
def test_through_the_writer_a_settlement_whose_key_was_taken_is_a_conflict_and_keeps_its_hold(pg_ledger, pg_engine,
                                                                                                 settlements):
    """The writer does not look up under the lock the key of a settlement that
    just closed its hold: the log's unique index refuses it, and the batch
    runs again looking every key up. The mistake is answered
    IdempotencyConflict, its hold is still held, and the others settle once."""
    customer = customer_with(pg_ledger, USD * 10)
    owner = pg_ledger.create_account(cmd.OWNER, "owner")
    settles = _settlements(pg_ledger, [customer], owner, holds_each=settlements)
    refused = settles[-1]
    pg_ledger.append(cmd.GrantCredits(customer, 1, "takes the key", refused.idempotency_key))
    before = money_snapshot(pg_engine)
    futures = [pg_ledger.appender.submit(settle) for settle in settles]
    with pytest.raises(Exception) as raised:
        futures[-1].result(timeout=30)
    assert type(raised.value).__name__ == "IdempotencyConflict"
    assert all(f.result(timeout=30).status == "created" for f in futures[:-1])
    after = money_snapshot(pg_engine)
    assert after["events"] == before["events"] + settlements - 1
    assert after["balances"][customer] == before["balances"][customer] - (settlements - 1) * CHARGE
    assert _held_and_available(pg_ledger, customer)[0] == HOLD, "the refused one's hold is still held"


@pytest.mark.parametrize("ids, amounts", [("{1,2}", "{5}"), ("{1,1}", "{5,5}"), ("{1}", "{NULL}")],
                         ids=["lengths differ", "an account twice", "no amount"])
def test_closes_announced_malformed_are_refused_and_nothing_moves(pg_ledger, pg_engine, ids, amounts):
    customer = customer_with(pg_ledger, USD)
    before = money_snapshot(pg_engine)
    with pytest.raises(DBAPIError, match="announced malformed"):
        with pg_engine.begin() as conn:
            with _announcing(ids, amounts):
                append_batch(conn, [cmd.GrantCredits(customer, USD, "more", key("grant"))])
    assert money_snapshot(pg_engine) == before


@contextmanager
def _announcing(ids: str, amounts: str):
    """The writer's announcement at the lock, made of these two texts whatever the batch closes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(postgres, "_closes", lambda holds_closed: {"ids": ids, "amounts": amounts})
        yield


@pytest.mark.parametrize("closed", [HOLD + 1, -1], ids=["more than was placed", "backwards"])
def test_a_close_the_guard_refuses_is_refused_whole_and_nothing_moves(pg_ledger, pg_engine, closed):
    """The announcement is the writer's to make (other SQL's is replaced at
    the lock, so it is made here as a writer would, before the rows), but
    the balance guard holds every close to what was placed, whoever updates the row."""
    customer = customer_with(pg_ledger, USD)
    pg_ledger.place_hold(PlaceHold(customer, HOLD, key("hold")))
    before, books_before = money_snapshot(pg_engine), _held_and_available(pg_ledger, customer)
    with pytest.raises(DBAPIError, match="without the events"):
        with pg_engine.begin() as conn:
            with _announcing(f"{{{customer}}}", f"{{{closed}}}"):
                append_batch(conn, [cmd.GrantCredits(customer, USD, "more", key("grant"))])
    assert (money_snapshot(pg_engine), _held_and_available(pg_ledger, customer)) == (before, books_before)


def test_a_batch_that_wrote_nothing_leaves_no_close_for_the_next(pg_ledger, pg_engine):
    """Its only settlement refused under the lock, a batch writes no event;
    what it announced must not close the hold in a later append of the same
    transaction, which settles nothing."""
    customer = customer_with(pg_ledger, USD)
    owner = pg_ledger.create_account(cmd.OWNER, "owner")
    [refused] = _settlements(pg_ledger, [customer], owner, holds_each=1)
    pg_ledger.append(cmd.GrantCredits(customer, 1, "takes the key", refused.idempotency_key))
    with pg_engine.begin() as conn:
        assert type(append_batch(conn, [refused])[0]).__name__ == "IdempotencyConflict"
        assert append_batch(conn, [cmd.GrantCredits(customer, 1, "later", key("grant"))])[0].status == "created"
    assert _held_and_available(pg_ledger, customer) == (HOLD, USD + 2 - HOLD)


def test_closes_left_in_the_settings_are_never_taken(pg_ledger, pg_engine, postgres_url):
    """Set by other SQL in the transaction, or as a default of the database:
    each lock's announcement replaces them."""
    customer = customer_with(pg_ledger, USD)
    pg_ledger.place_hold(PlaceHold(customer, HOLD, key("hold")))
    with pg_engine.begin() as conn:
        conn.execute(text(_ANNOUNCE), {"ids": f"{{{customer}}}", "amounts": f"{{{HOLD}}}"})
        append_batch(conn, [cmd.GrantCredits(customer, 1, "after other SQL", key("grant"))])
    database = make_url(postgres_url).database
    with pg_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for name, value in (("holds_closed_account_ids", f"{{{customer}}}"), ("holds_closed_nano_usd", f"{{{HOLD}}}")):
            conn.execute(text(f"ALTER DATABASE \"{database}\" SET paralon.{name} = '{value}'"))
    pg_engine.dispose()  # new sessions take the defaults
    with pg_engine.connect() as conn:
        assert conn.execute(text("SELECT current_setting('paralon.holds_closed_nano_usd')")).scalar_one() == f"{{{HOLD}}}"
    pg_ledger.append(cmd.GrantCredits(customer, 1, "with the defaults", key("grant")))
    assert _held_and_available(pg_ledger, customer) == (HOLD, USD + 2 - HOLD)
