"""The ledger's rules, on SQLite and on PostgreSQL (one shared suite)."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import select, text

from ledger import commands as cmd
from ledger.accounts import create_system_account
from ledger.errors import (
    CaptureExceedsHold,
    HoldNotActive,
    IdempotencyConflict,
    InsufficientFunds,
    InvalidAmount,
    InvalidInput,
    NotReversible,
    UnknownAccount,
    UnknownEvent,
    WrongAccountKind,
)
from ledger.holds import PlaceHold, expire_holds, place_holds
from ledger.limits import REASON_CHARS_MAX
from ledger.log import consume_once, consumer_position, read_events
from ledger.schema import accounts, utc_now
from ledger.store import append_batch
from ledger.verify import rebuild_balances, verify
from tests.ledger.helpers import customer_with, key, leg_changed, leg_removed, money_snapshot, postings_in_event_row
from tests.support.tampering import tamper_as_superuser

USD = 1_000_000_000


def test_grant_raises_credits_and_its_counter_account_by_the_same_amount(ledger, engine):
    customer = customer_with(ledger, 0)
    result = ledger.append(cmd.GrantCredits(customer, 12 * USD + 500_000_000, "welcome", key()))
    assert result.status == "created"
    assert ledger.balance(customer).available_nano_usd == 12_500_000_000
    with engine.connect() as conn:
        [event] = read_events(conn, result.seq - 1, 1)
    assert event.event_type == "CreditsGranted"
    assert sum(amount for _, amount in event.postings) == 0


def test_same_key_same_content_returns_the_original_event(ledger, engine):
    customer = customer_with(ledger, 0)
    grant = cmd.GrantCredits(customer, 5 * USD, "welcome", "grant-once")
    first = ledger.append(grant)
    before = money_snapshot(engine)
    again = ledger.append(grant)
    assert (again.status, again.seq) == ("exists", first.seq)
    assert money_snapshot(engine) == before


def test_same_key_other_content_is_a_conflict_and_moves_nothing(ledger, engine):
    customer = customer_with(ledger, 0)
    ledger.append(cmd.GrantCredits(customer, 5 * USD, "welcome", "grant-k"))
    before = money_snapshot(engine)
    with pytest.raises(IdempotencyConflict) as caught:
        ledger.append(cmd.GrantCredits(customer, 6 * USD, "welcome", "grant-k"))
    assert caught.value.code == "exists_with_different_content"
    assert money_snapshot(engine) == before


@pytest.mark.parametrize(
    "bad, error",
    [
        (lambda a: cmd.GrantCredits(a, 0, "zero", key()), InvalidAmount),
        (lambda a: cmd.GrantCredits(a, -5, "negative", key()), InvalidAmount),
        (lambda a: cmd.GrantCredits(a, 5, "   ", key()), InvalidInput),
        (lambda a: cmd.GrantCredits(a + 999, 5, "nobody", key()), UnknownAccount),
        (lambda a: cmd.AdjustBalance(a, -11 * USD, "too much", key()), InsufficientFunds),
        (lambda a: cmd.AdjustBalance(a, 0, "nothing", key()), InvalidAmount),
        (lambda a: cmd.ReverseEvent(10_000, "no such event", key()), UnknownEvent),
        (lambda a: cmd.GrantCredits(a, 5, "nul \x00 inside", key()), InvalidInput),
        (lambda a: cmd.GrantCredits(a, 5, "fine", "lone surrogate \ud800"), InvalidInput),
        (lambda a: cmd.SettleRequest(1, a, 5, "r", key(), {"tokens": 1.5}), InvalidInput),
        (lambda a: cmd.SettleRequest(1, a, 5, "r", key(), {"tokens": 2**64}), InvalidInput),
        (lambda a: cmd.SettleRequest(1, a, 0, "r", key(), {}), InvalidAmount),
        (lambda a: cmd.SettleRequest(2**64, a, 5, "r", key(), {}), InvalidInput),
        (lambda a: cmd.SettleRequest(-1, a, 5, "r", key(), {}), InvalidInput),
        (lambda a: cmd.SettleRequest("1", a, 5, "r", key(), {}), InvalidInput),
        (lambda a: cmd.SettleRequest(1, True, 5, "r", key(), {}), InvalidInput),
        # A metadata text is refused as any other text: NUL, blank, too long, not Unicode.
        (lambda a: cmd.SettleRequest(1, a, 5, "r", key(), {"model": "nul \x00 inside"}), InvalidInput),
        (lambda a: cmd.SettleRequest(1, a, 5, "r", key(), {"model": " \t\n"}), InvalidInput),
        (lambda a: cmd.SettleRequest(1, a, 5, "r", key(), {"model": "m" * (REASON_CHARS_MAX + 1)}), InvalidInput),
        (lambda a: cmd.SettleRequest(1, a, 5, "r", key(), {"model": "lone surrogate \ud800"}), InvalidInput),
    ],
)
def test_bad_commands_fail_with_a_typed_error_and_move_nothing(ledger, engine, bad, error):
    customer = customer_with(ledger, 10 * USD)
    before = money_snapshot(engine)
    with pytest.raises(error):
        ledger.append(bad(customer))
    assert money_snapshot(engine) == before


def test_grant_to_an_owner_is_refused(ledger, engine):
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    before = money_snapshot(engine)
    with pytest.raises(WrongAccountKind):
        ledger.append(cmd.GrantCredits(owner, USD, "wrong", key()))
    assert money_snapshot(engine) == before


def test_settlement_pays_the_owner_80_percent_and_releases_the_rest_of_the_hold(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    hold = ledger.place_hold(PlaceHold(customer, 3 * USD, key("hold")))
    assert ledger.balance(customer).available_nano_usd == 7 * USD
    charge = 1_234_567_891
    ledger.append(cmd.SettleRequest(hold.hold_id, owner, charge, "req-1", key("settle"), {"model": "m", "completion_tokens": 7}))
    customer_view, owner_view = ledger.balance(customer), ledger.balance(owner)
    assert customer_view.held_nano_usd == 0
    assert customer_view.available_nano_usd == 10 * USD - charge
    assert owner_view.balance_nano_usd == charge * 80 // 100 == 987_654_312
    platform_id = _system(engine, cmd.PLATFORM_REVENUE_ACCOUNT)
    assert ledger.balance(platform_id).balance_nano_usd == charge - charge * 80 // 100


def test_a_hold_cannot_be_settled_twice_nor_beyond_its_amount(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    hold = ledger.place_hold(PlaceHold(customer, USD, key("hold")))
    with pytest.raises(CaptureExceedsHold):
        ledger.append(cmd.SettleRequest(hold.hold_id, owner, USD + 1, "r", key(), {}))
    ledger.append(cmd.SettleRequest(hold.hold_id, owner, USD // 2, "r", key(), {}))
    before = money_snapshot(engine)
    with pytest.raises(HoldNotActive):
        ledger.append(cmd.SettleRequest(hold.hold_id, owner, 1, "r", key(), {}))
    with pytest.raises(HoldNotActive):
        ledger.append(cmd.SettleRequest(987_654, owner, 1, "r", key(), {}))
    assert money_snapshot(engine) == before


def test_a_settlement_charging_more_than_the_credits_a_refund_left_is_refused_and_moves_nothing(ledger, engine):
    """A refund takes credits whatever holds are placed (the money has left).
    Settlements are then checked against the credits left, under the append
    lock and after each other: one charging more is refused and its hold stays
    to be released; one charging exactly what is left is appended, and the
    next one, finding nothing left, is refused."""
    with engine.begin() as conn:
        create_system_account(conn, "external:card", "Card payments")
    customer = customer_with(ledger, 12 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    holds = [ledger.place_hold(PlaceHold(customer, 4 * USD, key("hold"))) for _ in range(3)]
    ledger.append(cmd.RefundCredits(customer, 9 * USD, "card", "re_1", "external:card", key("refund")))
    before = money_snapshot(engine)
    with pytest.raises(InsufficientFunds):
        ledger.append(cmd.SettleRequest(holds[0].hold_id, owner, 3 * USD + 1, "r0", key("settle"), {}))
    assert money_snapshot(engine) == before, "nothing moved and the hold is still active"
    exact, after_it = (ledger.appender.submit(cmd.SettleRequest(hold.hold_id, owner, charge, f"r{i}", key("settle"), {}))
                       for i, (hold, charge) in enumerate([(holds[1], 3 * USD), (holds[2], 1)], start=1))
    assert exact.result().status == "created"
    with pytest.raises(InsufficientFunds):
        after_it.result()
    assert ledger.balance(customer).balance_nano_usd == 0
    with engine.connect() as conn:
        assert verify(conn).ok


# Characters a database's bulk formats treat specially: tab, newline, carriage
# return and backslash (COPY), quotes and braces (array literals), and beyond ASCII.
AWKWARD_TEXT = 'tab\there\nnew line\r\\N \\x00 "quoted" {braced,} 50% %(keys)s %s \'single\'; -- \u00e9\u4e2d\U0001f600'


def test_awkward_text_in_keys_reasons_and_metadata_is_stored_as_given_and_verifies(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    hold = ledger.place_hold(PlaceHold(customer, USD, key("hold")))
    grant = ledger.append(cmd.GrantCredits(customer, USD, AWKWARD_TEXT, "grant " + AWKWARD_TEXT))
    settled = ledger.append(cmd.SettleRequest(hold.hold_id, owner, 1_000, AWKWARD_TEXT, "settle " + AWKWARD_TEXT,
                                              {"model": AWKWARD_TEXT, AWKWARD_TEXT: 1}))
    with engine.connect() as conn:
        events = {e.seq: e for e in read_events(conn, grant.seq - 1, 2)}
        report = verify(conn)
    assert events[grant.seq].idempotency_key == "grant " + AWKWARD_TEXT
    assert json.loads(events[grant.seq].payload_json)["reason"] == AWKWARD_TEXT
    assert events[settled.seq].idempotency_key == "settle " + AWKWARD_TEXT
    assert json.loads(events[settled.seq].payload_json)["meta"] == {"model": AWKWARD_TEXT, AWKWARD_TEXT: 1}
    assert report.ok, report
    again = ledger.append(cmd.GrantCredits(customer, USD, AWKWARD_TEXT, "grant " + AWKWARD_TEXT))
    assert (again.status, again.seq) == ("exists", grant.seq), "the stored key is found again"


def test_a_settlement_whose_key_another_event_has_is_a_conflict_and_its_hold_stays(ledger, engine):
    """The writer leaves a closing settlement's key to the log's unique index:
    refused there, its batch runs again looking up every key, and the
    settlement gets its conflict while the others of the batch are appended."""
    customer = customer_with(ledger, 10 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    taken = key("settle")
    ledger.append(cmd.GrantCredits(customer, USD, "welcome", taken))
    hold, other = (ledger.place_hold(PlaceHold(customer, USD, key("hold"))) for _ in range(2))
    before = money_snapshot(engine)
    reused = ledger.appender.submit(cmd.SettleRequest(hold.hold_id, owner, USD // 2, "req-1", taken, {}))
    fine = ledger.appender.submit(cmd.SettleRequest(other.hold_id, owner, USD // 4, "req-2", key("settle"), {}))
    with pytest.raises(IdempotencyConflict):
        reused.result()
    assert fine.result().status == "created"
    assert money_snapshot(engine)["events"] == before["events"] + 1
    assert ledger.balance(customer).held_nano_usd == USD, "the conflicting settlement's hold is still held"
    assert ledger.append(cmd.SettleRequest(hold.hold_id, owner, USD // 2, "req-1", key("settle"), {})).status == "created"
    with engine.connect() as conn:
        assert verify(conn).ok


def test_holds_never_take_available_below_zero(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    ledger.place_hold(PlaceHold(customer, 6 * USD, key("hold")))
    before = money_snapshot(engine)
    with pytest.raises(InsufficientFunds):
        ledger.place_hold(PlaceHold(customer, 4 * USD + 1, key("hold")))
    assert money_snapshot(engine) == before
    ledger.place_hold(PlaceHold(customer, 4 * USD, key("hold")))
    assert ledger.balance(customer).available_nano_usd == 0


def test_a_hold_with_a_minimum_takes_what_is_available_down_to_that_minimum(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    ledger.place_hold(PlaceHold(customer, 7 * USD, key("hold")))
    partial = ledger.place_hold(PlaceHold(customer, 5 * USD, key("hold"), minimum_nano_usd=USD))
    assert partial.amount_nano_usd == 3 * USD and ledger.balance(customer).available_nano_usd == 0
    before = money_snapshot(engine)
    with pytest.raises(InsufficientFunds):
        ledger.place_hold(PlaceHold(customer, 5 * USD, key("hold"), minimum_nano_usd=1))
    assert money_snapshot(engine) == before
    with pytest.raises(InvalidInput):
        ledger.place_hold(PlaceHold(customer, USD, key("hold"), minimum_nano_usd=2 * USD))


def test_hold_keys_repeated_inside_one_batch(ledger, engine):
    """A repeat answers like its first occurrence when that was placed, is a
    conflict with other content, and is tried on its own when the first was refused."""
    customer = customer_with(ledger, 10 * USD)
    batch = [
        PlaceHold(customer, USD, "k1"), PlaceHold(customer, USD, "k1"), PlaceHold(customer, 2 * USD, "k1"),
        PlaceHold(customer, 50 * USD, "k2"), PlaceHold(customer, 3 * USD, "k2"),
    ]
    with engine.begin() as conn:
        first, repeat, other, refused, retried = place_holds(conn, batch)
    assert first.status == "created" and (repeat.status, repeat.hold_id) == ("exists", first.hold_id)
    assert isinstance(other, IdempotencyConflict) and isinstance(refused, InsufficientFunds)
    assert retried.status == "created" and retried.amount_nano_usd == 3 * USD
    assert ledger.balance(customer).held_nano_usd == 4 * USD


def test_a_usage_discrepancy_is_an_event_that_moves_no_money(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    before = money_snapshot(engine)["balances"]
    result = ledger.append(cmd.RecordUsageDiscrepancy("req-1", 7, 40, 300, 40, 100, key("discrepancy")))
    assert result.status == "created"
    assert money_snapshot(engine)["balances"] == before
    with pytest.raises(NotReversible):
        ledger.append(cmd.ReverseEvent(result.seq, "nothing to undo", key()))
    with engine.connect() as conn:
        assert verify(conn).ok
    assert ledger.balance(customer).available_nano_usd == 10 * USD


def test_a_debit_outside_a_hold_cannot_spend_what_holds_reserve(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    ledger.place_hold(PlaceHold(customer, 8 * USD, key("hold")))
    before = money_snapshot(engine)
    with pytest.raises(InsufficientFunds):
        ledger.append(cmd.AdjustBalance(customer, -3 * USD, "correction", key()))
    assert money_snapshot(engine) == before
    ledger.append(cmd.AdjustBalance(customer, -2 * USD, "correction", key()))
    assert ledger.balance(customer).available_nano_usd == 0


def test_release_and_expiry_give_the_reservation_back_without_moving_money(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    released = ledger.place_hold(PlaceHold(customer, 2 * USD, key("hold")))
    ledger.place_hold(PlaceHold(customer, 3 * USD, key("hold"), ttl_s=60))
    before = money_snapshot(engine)["balances"]
    assert ledger.release_hold(released.hold_id) is True
    assert ledger.release_hold(released.hold_id) is False
    with engine.begin() as conn:
        assert expire_holds(conn, now=utc_now()) == 0
        assert expire_holds(conn, now=utc_now() + timedelta(seconds=61)) == 1
    view = ledger.balance(customer)
    assert (view.held_nano_usd, view.available_nano_usd) == (0, 10 * USD)
    assert money_snapshot(engine)["balances"] == before


def test_hold_key_reused_with_another_amount_is_a_conflict(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    first = ledger.place_hold(PlaceHold(customer, USD, "hold-k"))
    assert ledger.place_hold(PlaceHold(customer, USD, "hold-k")).hold_id == first.hold_id
    with pytest.raises(IdempotencyConflict):
        ledger.place_hold(PlaceHold(customer, 2 * USD, "hold-k"))
    assert ledger.balance(customer).held_nano_usd == USD


def test_reversal_negates_an_event_once(ledger, engine):
    customer = customer_with(ledger, 0)
    grant = ledger.append(cmd.GrantCredits(customer, 4 * USD, "by mistake", key()))
    reversal = ledger.append(cmd.ReverseEvent(grant.seq, "granted by mistake", key()))
    assert reversal.event_type == "EventReversed"
    assert ledger.balance(customer).balance_nano_usd == 0
    before = money_snapshot(engine)
    with pytest.raises(NotReversible):
        ledger.append(cmd.ReverseEvent(grant.seq, "again", key()))
    with pytest.raises(NotReversible):
        ledger.append(cmd.ReverseEvent(reversal.seq, "reverse a reversal", key()))
    assert money_snapshot(engine) == before


def test_reversal_of_spent_credits_is_refused(ledger, engine):
    customer = customer_with(ledger, 0)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    grant = ledger.append(cmd.GrantCredits(customer, 4 * USD, "promo", key()))
    hold = ledger.place_hold(PlaceHold(customer, 3 * USD, key("hold")))
    ledger.append(cmd.SettleRequest(hold.hold_id, owner, 3 * USD, "r", key(), {}))
    before = money_snapshot(engine)
    with pytest.raises(InsufficientFunds):
        ledger.append(cmd.ReverseEvent(grant.seq, "promo withdrawn", key()))
    assert money_snapshot(engine) == before


def test_one_overdraft_does_not_fail_the_rest_of_its_batch(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    commands = [cmd.AdjustBalance(customer, -3 * USD, f"debit {i}", key()) for i in range(4)]
    futures = [ledger.appender.submit(c) for c in commands]
    outcomes = []
    for future in futures:
        try:
            outcomes.append(future.result().status)
        except InsufficientFunds:
            outcomes.append("overdraft")
    assert outcomes.count("created") == 3 and outcomes.count("overdraft") == 1
    assert ledger.balance(customer).available_nano_usd == USD


@pytest.mark.parametrize("refused_at", [0, 2, 4], ids=["first", "middle", "last"])
def test_a_command_refused_under_the_lock_leaves_the_others_of_its_batch_written_as_their_own(ledger, engine, refused_at):
    """Events are drafted before the append lock and some refused under it: each
    event written must carry its own key, payload and postings (none for an
    event that moves no money), and chain."""
    customer = customer_with(ledger, 10 * USD)
    with engine.connect() as conn:
        after = conn.execute(text("SELECT max(seq) FROM ledger_events")).scalar_one()
    commands = [cmd.AdjustBalance(customer, -dollars * USD, f"debit of {dollars}", key()) for dollars in (3, 4, 2)]
    commands.insert(1, cmd.RecordUsageDiscrepancy("req-between-debits", 7, 40, 300, 40, 100, key()))
    commands.insert(refused_at, cmd.AdjustBalance(customer, -11 * USD, "more than the balance", key()))
    with engine.begin() as conn:
        results = append_batch(conn, commands)
    assert isinstance(results[refused_at], InsufficientFunds)
    expected = [c for i, c in enumerate(commands) if i != refused_at]
    with engine.connect() as conn:
        written = read_events(conn, after)
    assert [e.idempotency_key for e in written] == [c.idempotency_key for c in expected]
    for event, command in zip(written, expected):
        payload = json.loads(event.payload_json)
        if isinstance(command, cmd.AdjustBalance):
            assert (payload["reason"], event.postings[0], len(event.postings)) == (command.reason, (customer, command.delta_nano_usd), 2)
        else:
            assert (payload["request_id"], list(event.postings)) == (command.request_id, [])
    assert ledger.balance(customer).available_nano_usd == USD
    assert verify_now(engine).ok


def test_the_log_refuses_update_and_delete(engine, ledger):
    customer_with(ledger, USD)
    in_event_row = postings_in_event_row(engine)
    legs = ["UPDATE ledger_events SET posting_amounts_nano_usd = NULL"] if in_event_row else [
        "UPDATE ledger_postings SET amount_nano_usd = 0", "DELETE FROM ledger_postings"]
    for statement in ("UPDATE ledger_events SET payload = '{}'", "DELETE FROM ledger_events", *legs):
        with pytest.raises(Exception, match="append-only"):
            with engine.begin() as conn:
                conn.execute(text(statement))
    if engine.dialect.name == "postgresql":
        for table in ("ledger_events", "ledger_postings"):
            with pytest.raises(Exception, match="append-only"):
                with engine.begin() as conn:
                    conn.execute(text(f"TRUNCATE {table} CASCADE"))
    assert verify_now(engine).ok


@pytest.mark.parametrize(
    "edit, expected",
    [
        ("UPDATE ledger_events SET payload = replace(payload, 'welcome', 'welcomE') WHERE seq = 1", "event 1 (CreditsGranted): stored hash"),
        (lambda engine: leg_changed(engine, 2, 0, 1), "event 2 (CreditsGranted): postings sum to 1"),
        (lambda engine: leg_removed(engine, 2, 1), "event 2 (CreditsGranted): postings sum to"),
        ("UPDATE account_balances SET balance_nano_usd = balance_nano_usd + 7 WHERE account_id = (SELECT max(account_id) FROM account_balances)", "differs by 7"),
    ],
)
def test_verify_finds_a_superuser_edit(engine, ledger, edit, expected):
    customer = customer_with(ledger, 0)
    ledger.append(cmd.GrantCredits(customer, USD, "welcome", key()))
    ledger.append(cmd.GrantCredits(customer, 2 * USD, "second", key()))
    assert verify_now(engine).ok
    tamper_as_superuser(engine, edit if isinstance(edit, str) else edit(engine))
    report = verify_now(engine)
    assert not report.ok
    assert any(expected in problem for problem in report.problems), report.problems


def test_replay_equals_the_inline_balances(engine, ledger):
    customer = customer_with(ledger, 20 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    for i in range(10):
        hold = ledger.place_hold(PlaceHold(customer, USD, key("hold")))
        ledger.append(cmd.SettleRequest(hold.hold_id, owner, 1000 * (i + 1) + 7, f"r{i}", key(), {}))
    inline = money_snapshot(engine)["balances"]
    tamper_as_superuser(engine, "UPDATE account_balances SET balance_nano_usd = 0")
    with engine.begin() as conn:
        rebuild_balances(conn)
    assert money_snapshot(engine)["balances"] == inline
    assert verify_now(engine).ok


def test_a_consumer_sees_every_event_once_in_order(engine, ledger):
    customer = customer_with(ledger, 0)
    for _ in range(7):
        ledger.append(cmd.GrantCredits(customer, USD, "g", key()))
    seen = []
    while consume_once(engine, "test-consumer", lambda conn, page: seen.extend(e.seq for e in page), page_size=3):
        pass
    assert seen == list(range(1, 8))
    with engine.connect() as conn:
        assert consumer_position(conn, "test-consumer") == 7


def verify_now(engine):
    with engine.connect() as conn:
        return verify(conn)


def _system(engine, code: str) -> int:
    with engine.connect() as conn:
        return conn.execute(select(accounts.c.id).where(accounts.c.system_code == code)).scalar_one()


NASTY_TEXTS = ['say "hi"', "back\\slash", "{braces},commas", "NULL", "ünïcödé ✓ 雪", "tab\tnew\nline", "'single'"]


def test_any_text_survives_the_batch_writer_and_the_chain(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    for i, nasty in enumerate(NASTY_TEXTS):
        grant = ledger.append(cmd.GrantCredits(customer, i + 1, nasty, f"{nasty}:{i}"))
        hold = ledger.place_hold(PlaceHold(customer, 100, f"hold {nasty} {i}"))
        ledger.append(cmd.SettleRequest(hold.hold_id, owner, 50, nasty, f"settle {nasty} {i}", {"model": nasty, "n": i}))
        with engine.connect() as conn:
            [stored] = read_events(conn, grant.seq - 1, 1)
        assert stored.payload["reason"] == nasty and stored.idempotency_key == f"{nasty}:{i}"
    assert verify_now(engine).ok


def test_a_key_repeated_inside_one_batch_answers_like_the_first(ledger, engine):
    customer = customer_with(ledger, 10 * USD)
    with engine.begin() as conn:
        placed, repeated, conflicting = place_holds(
            conn, [PlaceHold(customer, USD, "batch-hold"), PlaceHold(customer, USD, "batch-hold"), PlaceHold(customer, 2 * USD, "batch-hold")]
        )
    assert placed.status == "created" and (repeated.status, repeated.hold_id) == ("exists", placed.hold_id)
    assert isinstance(conflicting, IdempotencyConflict)
    grant = cmd.GrantCredits(customer, USD, "twice", "batch-grant")
    with engine.begin() as conn:
        first, again, other = append_batch(conn, [grant, grant, cmd.GrantCredits(customer, 2 * USD, "twice", "batch-grant")])
    assert first.status == "created" and (again.status, again.seq) == ("exists", first.seq)
    assert isinstance(other, IdempotencyConflict)
    view = ledger.balance(customer)
    assert (view.balance_nano_usd, view.held_nano_usd) == (11 * USD, USD)
