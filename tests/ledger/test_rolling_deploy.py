"""A rolling deploy across migration 0015: replicas of the previous release
still call the function that places holds without a replica, and it works."""
from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import text

from ledger.service import Ledger
from tests.ledger.helpers import customer_with

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
