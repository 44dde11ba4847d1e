"""Random command sequences against a tiny in-memory model of the ledger.

After every step the stored balances and holds equal the model's, and no
customer's available balance is below zero; at the end `verify` proves the
hash chain, the zero sums and the replayed balances. Runs on SQLite and on
PostgreSQL."""
from __future__ import annotations

import uuid
from datetime import timedelta

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from ledger import commands as cmd
from ledger.db import make_engine
from ledger.errors import (
    CaptureExceedsHold,
    InsufficientFunds,
    NotReversible,
)
from ledger.holds import PlaceHold, expire_holds
from ledger.money import split_charge
from ledger.schema import utc_now
from ledger.service import Ledger
from ledger.verify import verify

AMOUNTS = st.integers(min_value=1, max_value=5_000)


class LedgerMachine(RuleBasedStateMachine):
    database_url: str = ""

    @initialize()
    def open_ledger(self):
        self.engine = make_engine(self.database_url)
        self.ledger = Ledger(self.engine, batch_wait_ms=0)
        run = uuid.uuid4().hex[:8]
        self.key_prefix = run
        self.customers = [self.ledger.create_account(cmd.CUSTOMER, f"c{i}-{run}") for i in range(2)]
        self.owners = [self.ledger.create_account(cmd.OWNER, f"o{i}-{run}") for i in range(2)]
        self.balance = {a: 0 for a in self.customers + self.owners}
        self.holds: dict[int, tuple[int, int]] = {}  # active: hold id -> (customer, amount)
        self.events: list[tuple[int, list[tuple[int, int]]]] = []  # (seq, postings on model accounts)
        self.reversed: set[int] = set()
        self.counter = 0

    def teardown(self):
        if hasattr(self, "ledger"):
            self.ledger.close()
            with self.engine.connect() as conn:
                report = verify(conn)
            self.engine.dispose()
            assert report.ok, report.problems

    def key(self) -> str:
        self.counter += 1
        return f"{self.key_prefix}:{self.counter}"

    def held(self, customer: int) -> int:
        return sum(amount for c, amount in self.holds.values() if c == customer)

    @rule(i=st.integers(0, 1), amount=AMOUNTS)
    def grant(self, i, amount):
        customer = self.customers[i]
        result = self.ledger.append(cmd.GrantCredits(customer, amount, "grant", self.key()))
        self.balance[customer] += amount
        self.events.append((result.seq, [(customer, amount)]))

    @rule(i=st.integers(0, 3), delta=st.integers(-5_000, 5_000).filter(bool))
    def adjust(self, i, delta):
        account = (self.customers + self.owners)[i]
        after = self.balance[account] + delta - (self.held(account) if account in self.customers else 0)
        try:
            result = self.ledger.append(cmd.AdjustBalance(account, delta, "correction", self.key()))
        except InsufficientFunds:
            assert after < 0
            return
        assert after >= 0
        self.balance[account] += delta
        self.events.append((result.seq, [(account, delta)]))

    @rule(i=st.integers(0, 1), amount=AMOUNTS)
    def place_hold(self, i, amount):
        customer = self.customers[i]
        available = self.balance[customer] - self.held(customer)
        try:
            hold = self.ledger.place_hold(PlaceHold(customer, amount, self.key()))
        except InsufficientFunds:
            assert amount > available
            return
        assert amount <= available
        self.holds[hold.hold_id] = (customer, amount)

    @precondition(lambda self: self.holds)
    @rule(data=st.data(), o=st.integers(0, 1))
    def settle(self, data, o):
        hold_id = data.draw(st.sampled_from(sorted(self.holds)))
        customer, amount = self.holds[hold_id]
        charge = data.draw(st.integers(1, amount + 2))
        owner = self.owners[o]
        try:
            result = self.ledger.append(cmd.SettleRequest(hold_id, owner, charge, f"r{self.counter}", self.key(), {"model": "m"}))
        except CaptureExceedsHold:
            assert charge > amount
            return
        assert charge <= amount
        owner_share, _ = split_charge(charge)
        del self.holds[hold_id]
        self.balance[customer] -= charge
        self.balance[owner] += owner_share
        self.events.append((result.seq, [(customer, -charge), (owner, owner_share)]))

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release(self, data):
        hold_id = data.draw(st.sampled_from(sorted(self.holds)))
        assert self.ledger.release_hold(hold_id) is True
        assert self.ledger.release_hold(hold_id) is False
        del self.holds[hold_id]

    @rule()
    def expire_everything_due(self):
        with self.engine.begin() as conn:
            expire_holds(conn, now=utc_now() + timedelta(days=2))
        self.holds.clear()

    @precondition(lambda self: self.events)
    @rule(data=st.data())
    def reverse(self, data):
        seq, postings = data.draw(st.sampled_from(self.events))
        after = dict(self.balance)
        for account, amount in postings:
            after[account] -= amount
        overdrawn = any(
            after[a] - (self.held(a) if a in self.customers else 0) < 0 for a, amount in postings if amount > 0
        )
        try:
            self.ledger.append(cmd.ReverseEvent(seq, "undo", self.key()))
        except NotReversible:
            assert seq in self.reversed
            return
        except InsufficientFunds:
            assert overdrawn and seq not in self.reversed
            return
        assert seq not in self.reversed and not overdrawn
        self.reversed.add(seq)
        self.balance = after

    @rule()
    def retry_with_the_same_key(self):
        key = self.key()
        first = self.ledger.append(cmd.GrantCredits(self.customers[0], 7, "retry", key))
        again = self.ledger.append(cmd.GrantCredits(self.customers[0], 7, "retry", key))
        assert (again.status, again.seq) == ("exists", first.seq)
        self.balance[self.customers[0]] += 7
        self.events.append((first.seq, [(self.customers[0], 7)]))

    @invariant()
    def stored_state_equals_the_model(self):
        if not hasattr(self, "ledger"):
            return
        for account in self.customers + self.owners:
            view = self.ledger.balance(account)
            assert view.balance_nano_usd == self.balance[account]
            held = self.held(account) if account in self.customers else 0
            assert view.held_nano_usd == held
            assert view.available_nano_usd >= 0


def test_random_command_sequences_keep_the_ledger_equal_to_the_model(database_url):
    LedgerMachine.database_url = database_url
    run_state_machine_as_test(
        LedgerMachine,
        # PostgreSQL runs fewer examples: the rules are the same code on both, and
        # each PostgreSQL step waits for a flush; SQLite explores the sequences.
        settings=settings(max_examples=25 if database_url.startswith("sqlite") else 10, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]),
    )
