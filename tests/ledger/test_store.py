"""Appending in the caller's transaction: append_one's result, or its error raised."""
from __future__ import annotations

import pytest

from ledger import commands as cmd
from ledger.errors import IdempotencyConflict, InsufficientFunds
from ledger.store import CREATED, EXISTS, append_one
from tests.ledger.helpers import customer_with, key, money_snapshot


def test_append_one_returns_the_result_of_its_command(ledger, engine):
    customer = customer_with(ledger, 0)
    grant = cmd.GrantCredits(customer, 5, "credits", key())
    with engine.begin() as conn:
        created = append_one(conn, grant)
    with engine.begin() as conn:
        again = append_one(conn, grant)
    assert (created.status, again.status, again.seq) == (CREATED, EXISTS, created.seq)
    assert ledger.balance(customer).balance_nano_usd == 5


def test_append_one_raises_the_typed_error_and_writes_nothing(ledger, engine):
    customer = customer_with(ledger, 5)
    before = money_snapshot(engine)
    with pytest.raises(InsufficientFunds), engine.begin() as conn:
        append_one(conn, cmd.AdjustBalance(customer, -6, "too much", key()))
    with pytest.raises(IdempotencyConflict), engine.begin() as conn:
        taken = key()
        append_one(conn, cmd.GrantCredits(customer, 1, "first", taken))
        append_one(conn, cmd.GrantCredits(customer, 2, "other content", taken))
    assert money_snapshot(engine) == before, "the failed transaction rolled back whole"
