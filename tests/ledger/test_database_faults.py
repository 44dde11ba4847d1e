"""The group-commit writers when PostgreSQL goes away and comes back.

Holds and settlement statements run on the raw psycopg connection, whose
errors SQLAlchemy never sees: a terminated backend used to stay in the writer
for good, failing every later command with "the connection is closed"."""
from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.engine import make_url

from ledger import commands as cmd
from ledger.db import is_connection_failure, make_engine
from ledger.errors import DatabaseUnavailable
from ledger.holds import PlaceHold
from ledger.service import Ledger
from tests.conftest import _admin_engine
from tests.ledger.helpers import customer_with, key, money_snapshot
from tests.support.faults import FaultProxy
from tests.support.harness import wait_for

CREDITS_NANO_USD = 1_000_000
HOLD_NANO_USD = 1_000
HOLD_TTL_S = 60


def _terminate_backends(database: str) -> int:
    with _admin_engine().connect() as conn:
        return len(conn.execute(text(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :db AND pid <> pg_backend_pid()"
        ), {"db": database}).all())


@pytest.fixture
def proxied(postgres_url):
    """A ledger whose every connection goes through a fault proxy."""
    url = make_url(postgres_url)
    proxy = FaultProxy(url.host or "127.0.0.1", url.port or 5432).start()
    engine = make_engine(url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False))
    ledger = Ledger(engine)
    yield ledger, proxy, url.database
    ledger.close()
    engine.dispose()
    proxy.stop()


def _hold(account: int) -> PlaceHold:
    return PlaceHold(account, HOLD_NANO_USD, key("hold"), HOLD_TTL_S)


def test_the_writers_replace_a_terminated_connection(proxied):
    ledger, _, database = proxied
    customer = customer_with(ledger, CREDITS_NANO_USD)
    ledger.place_hold(_hold(customer))  # both writers hold a connection now
    assert _terminate_backends(database) > 0
    placed = ledger.place_hold(_hold(customer))  # was psycopg.OperationalError: the connection is closed
    grant = ledger.append(cmd.GrantCredits(customer, 1, "after the termination", key("grant")))
    assert placed.amount_nano_usd == HOLD_NANO_USD and grant.status == "created"
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (CREDITS_NANO_USD + 1, 2 * HOLD_NANO_USD)


def test_a_database_away_is_a_typed_error_and_nothing_moves(proxied):
    ledger, proxy, _ = proxied
    customer = customer_with(ledger, CREDITS_NANO_USD)
    before = money_snapshot(ledger.engine)
    proxy.outage()
    with pytest.raises(DatabaseUnavailable):
        ledger.place_hold(_hold(customer))
    with pytest.raises(DatabaseUnavailable):
        ledger.append(cmd.GrantCredits(customer, 1, "while away", key("grant")))
    proxy.restore()
    assert money_snapshot(ledger.engine) == before, "nothing was written while the database was away"
    placed = wait_for(lambda: _placed_or_none(ledger, customer), timeout_s=10)
    assert placed.amount_nano_usd == HOLD_NANO_USD, "back by itself once the database is"


def test_a_retried_batch_is_found_not_repeated(proxied):
    """The same commands sent again after a cut are answered from their idempotency keys."""
    ledger, proxy, _ = proxied
    customer = customer_with(ledger, CREDITS_NANO_USD)
    grant = cmd.GrantCredits(customer, 7, "once", key("grant"))
    hold = _hold(customer)
    first_grant, first_hold = ledger.append(grant), ledger.place_hold(hold)
    proxy.cut()
    again_grant, again_hold = ledger.append(grant), ledger.place_hold(hold)
    assert (again_grant.seq, again_hold.hold_id) == (first_grant.seq, first_hold.hold_id)
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (CREDITS_NANO_USD + 7, HOLD_NANO_USD)


def _placed_or_none(ledger: Ledger, customer: int):
    try:
        return ledger.place_hold(_hold(customer))
    except DatabaseUnavailable:
        return None


@pytest.mark.parametrize("error, failed", [
    (psycopg.OperationalError("the connection is closed"), True),  # the client found it gone: no SQLSTATE
    (psycopg.errors.AdminShutdown("terminating connection due to administrator command"), True),
    (psycopg.errors.ConnectionFailure("connection failure"), True),
    (psycopg.errors.SerializationFailure("could not serialize access"), False),  # an answer, retried as such
    (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), False),
    (psycopg.errors.UniqueViolation("duplicate key"), False),
    (ValueError("not the database's"), False),
])
def test_what_counts_as_the_database_away(error, failed):
    assert is_connection_failure(error) is failed  # raised by the raw connection
    if isinstance(error, psycopg.Error):  # the same, as SQLAlchemy wraps it
        assert is_connection_failure(DBAPIError.instance("SELECT 1", {}, error, psycopg.Error)) is failed
