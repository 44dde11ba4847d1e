"""Rolling deploys: replicas of the previous release keep working on the
migrated database, and this release refuses to write to one not migrated.

Across migration 0015, the previous release calls the function that places
holds without a replica; across 0030, it sets the balances its postings moved;
across 0035, it closes its settlements' holds after its rows."""
from __future__ import annotations

from contextlib import nullcontext
from datetime import UTC, datetime
from functools import partial

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from app.migrate import alembic_config, migrate
from ledger import commands as cmd
from ledger.db import make_engine, snapshot_connection
from ledger.errors import InvariantBroken
from ledger.hold_commands import PlaceHold
from ledger.log import read_events
from ledger.service import Ledger, append_now
from ledger.store import append_batch, set_postings_in_event_row
from ledger.verify import rebuild_balances, verify
from tests.ledger.helpers import customer_with, key, money_snapshot, postings_in_event_row
from tests.support.db_roles import app_role_url
from tests.support.previous_release import appending_as_before_0030, closing_holds_as_before_0035, set_balances_as_before_0030

USD = 10**9

_PREVIOUS_RELEASE_CALL = text(
    "SELECT status, hold_id, amount_nano_usd FROM paralon_place_holds("
    "ARRAY[:account]::bigint[], ARRAY[:amount]::bigint[], ARRAY[:amount]::bigint[], ARRAY['previous-release']::text[], "
    "ARRAY[30]::int[], ARRAY[NULL]::bigint[], :now)"
)


@pytest.fixture
def pg_ledger(pg_engine):
    ledger = Ledger(pg_engine)
    yield ledger
    ledger.close()


def test_the_previous_signature_still_places_holds(pg_ledger, pg_engine):
    customer = customer_with(pg_ledger, USD)
    with pg_engine.begin() as conn:
        status, hold_id, amount = conn.execute(_PREVIOUS_RELEASE_CALL, {"account": customer, "amount": USD // 4,
                                                                       "now": datetime.now(UTC)}).one()
        replica = conn.execute(text("SELECT replica_id FROM holds WHERE id = :id"), {"id": hold_id}).scalar_one()
    assert (status, amount, replica) == ("created", USD // 4, None), "swept like any other hold, by expiry"
    assert pg_ledger.balance(customer).available_nano_usd == USD - USD // 4


def test_the_previous_release_still_writes_the_balances_its_postings_moved(pg_ledger, pg_engine, postgres_url):
    """A replica of the previous release, after its postings, sets each balance it
    decided: the value the postings have just set, so nothing moves; a balance
    it got wrong is refused, not written."""
    customer = customer_with(pg_ledger, USD)
    service = make_engine(app_role_url(postgres_url))
    try:
        for off_by_nano_usd in (0, 1):
            with pytest.raises(DBAPIError, match="without the events") if off_by_nano_usd else nullcontext():
                with service.begin() as conn:
                    append_batch(conn, [cmd.GrantCredits(customer, USD, "more", key("grant"))])
                    last_seq = conn.execute(text("SELECT last_seq FROM ledger_head")).scalar_one()
                    set_balances_as_before_0030(conn, last_seq, {customer: 2 * USD + off_by_nano_usd})
    finally:
        service.dispose()
    assert pg_ledger.balance(customer).balance_nano_usd == 2 * USD
    with snapshot_connection(pg_engine) as conn:
        assert verify(conn).ok


@pytest.mark.parametrize("revision", ["0029", "0030"])
def test_this_release_refuses_to_append_before_its_migrations(pg_ledger, pg_engine, revision):
    """Deployed before its migrations (0030: its postings would move no balance;
    0031: its head has no say on where postings go): the batch is refused
    whole and nothing moves. A log whose events carry their postings in their
    rows cannot go back before 0031 at all: the releases before it would not
    see those postings."""
    customer = customer_with(pg_ledger, USD)
    if postings_in_event_row(pg_engine):
        before = money_snapshot(pg_engine)
        with pytest.raises(RuntimeError, match="cannot read them"):
            _downgrade(pg_engine, revision)
        assert money_snapshot(pg_engine) == before
        with pg_engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == \
                ScriptDirectory.from_config(alembic_config()).get_current_head(), "nothing of the downgrade stayed"
        return
    _downgrade(pg_engine, revision)
    before = money_snapshot(pg_engine)
    with pytest.raises(InvariantBroken, match="migration 0031"):
        append_now(pg_engine, cmd.GrantCredits(customer, USD, "more", key("grant")))
    assert money_snapshot(pg_engine) == before


def _settlement(ledger: Ledger, customer: int) -> cmd.SettleRequest:
    owner = ledger.create_account(cmd.OWNER, "owner")
    hold = ledger.place_hold(PlaceHold(customer, USD // 4, key("hold")))
    return cmd.SettleRequest(hold.hold_id, owner, USD // 10, key("req"), key("settle"))


def test_the_previous_release_still_closes_its_holds_once(pg_ledger, pg_engine):
    """It announces nothing, so the postings close nothing, and its own
    update after the rows closes each hold once."""
    customer = customer_with(pg_ledger, USD)
    settle = _settlement(pg_ledger, customer)
    with closing_holds_as_before_0035():
        assert pg_ledger.append(settle).status == "created"
    view = pg_ledger.balance(customer)
    assert (view.held_nano_usd, view.available_nano_usd) == (0, USD - USD // 10)
    with snapshot_connection(pg_engine) as conn:
        assert verify(conn).ok


@pytest.mark.parametrize("through", ["caller's transaction", "durable writer"])
def test_this_release_refuses_to_settle_before_migration_0035(pg_ledger, pg_engine, through):
    """Its postings would close no hold: the batch is refused whole, its hold
    stays held and nothing moves. Migrated again, the same settlement closes it.
    Through the durable writer, the head's move travels with the COMMIT: its
    refusal, on the server, stops the COMMIT from running."""
    customer = customer_with(pg_ledger, USD)
    settle = _settlement(pg_ledger, customer)
    append = pg_ledger.append if through == "durable writer" else partial(append_now, pg_engine)
    _downgrade(pg_engine, "0034")
    before, view_before = money_snapshot(pg_engine), pg_ledger.balance(customer)
    with pytest.raises(InvariantBroken, match="0035"):
        append(settle)
    assert (money_snapshot(pg_engine), pg_ledger.balance(customer)) == (before, view_before)
    assert view_before.held_nano_usd == USD // 4
    migrate(pg_engine)
    assert append(settle).status == "created"
    view = pg_ledger.balance(customer)
    assert (view.held_nano_usd, view.available_nano_usd) == (0, USD - USD // 10)


def _downgrade(engine, revision: str) -> None:
    with engine.begin() as conn:
        config = alembic_config()
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def test_a_log_written_as_rows_and_then_in_event_rows_reads_reverses_verifies_and_replays_as_one(pg_ledger, pg_engine):
    """Migration 0031's two layouts in one log: a replica of the previous release
    wrote rows, then postings went into their events' rows. Every reader gets each
    event's legs in order from either place; a reversal of either kind negates
    them; verify and a replay agree with the balances."""
    customer = customer_with(pg_ledger, 0)
    with appending_as_before_0030():
        as_rows = pg_ledger.append(cmd.GrantCredits(customer, 3 * USD, "as rows", key("grant")))
    with pg_engine.begin() as conn:
        set_postings_in_event_row(conn, True)
    in_row = pg_ledger.append(cmd.GrantCredits(customer, 5 * USD, "in its row", key("grant")))
    with pg_engine.connect() as conn:
        kept = dict(conn.execute(text("SELECT seq, posting_account_ids IS NOT NULL FROM ledger_events")).all())
        events = {e.seq: e.postings for e in read_events(conn, 0)}
    assert (kept[as_rows.seq], kept[in_row.seq]) == (False, True)
    counter = events[as_rows.seq][1][0]
    assert events[as_rows.seq] == [(customer, 3 * USD), (counter, -3 * USD)]
    assert events[in_row.seq] == [(customer, 5 * USD), (counter, -5 * USD)]
    for reversed_ in (as_rows, in_row):
        reversal = pg_ledger.append(cmd.ReverseEvent(reversed_.seq, "undo", key("reverse")))
        with pg_engine.connect() as conn:
            assert read_events(conn, reversal.seq - 1)[0].postings == [(a, -amount) for a, amount in events[reversed_.seq]]
    assert pg_ledger.balance(customer).balance_nano_usd == 0
    with snapshot_connection(pg_engine) as conn:
        assert verify(conn).ok
    before = money_snapshot(pg_engine)
    with pg_engine.begin() as conn:
        rebuild_balances(conn)
    assert money_snapshot(pg_engine) == before
