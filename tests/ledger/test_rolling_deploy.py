"""Rolling deploys: replicas of the previous release keep working on the
migrated database, and this release refuses to write to one not migrated.

Across migration 0015, the previous release calls the function that places
holds without a replica; across 0030, it sets the balances its postings moved."""
from __future__ import annotations

from contextlib import nullcontext
from datetime import UTC, datetime

import pytest
from alembic import command
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from app.migrate import alembic_config
from ledger import commands as cmd
from ledger.db import make_engine, snapshot_connection
from ledger.errors import InvariantBroken
from ledger.service import Ledger, append_now
from ledger.store import append_batch
from ledger.verify import verify
from tests.ledger.helpers import customer_with, key, money_snapshot
from tests.support.db_roles import app_role_url
from tests.support.previous_release import set_balances_as_before_0030

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


def test_this_release_refuses_to_append_where_postings_do_not_move_the_balances(pg_ledger, pg_engine):
    """Deployed before its migration (0030), this release's postings would move no
    balance: the batch is refused whole and nothing moves."""
    customer = customer_with(pg_ledger, USD)
    with pg_engine.begin() as conn:
        config = alembic_config()
        config.attributes["connection"] = conn
        command.downgrade(config, "0029")
    before = money_snapshot(pg_engine)
    with pytest.raises(InvariantBroken, match="did not move the balances"):
        append_now(pg_engine, cmd.GrantCredits(customer, USD, "more", key("grant")))
    assert money_snapshot(pg_engine) == before
