"""What every storage must do: one set of tests, run by each database's subclass.

`StorageContract` is not collected itself (its name does not start with
Test); `test_sqlite.TestSqliteStorage` and `test_postgres.TestPostgresStorage`
inherit every test and supply `storage_url`, a migrated database of the test's own.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from ledger import commands as cmd
from ledger import holds as hl
from ledger import spend_limits
from ledger.accounts import create_account, create_system_account, read_books
from ledger.db import make_engine, storage_of
from ledger.errors import BadDatabaseUrl
from ledger.events import GENESIS_HASH
from ledger.hold_commands import HoldRenewal, PlaceHold
from ledger.schema import accounts, customer_holds, holds, ledger_events, ledger_head, ledger_postings, utc_now
from ledger.service import append_now
from ledger.storage.base import HOLD_ROW, AppendedBatch, Storage
from tests.ledger.helpers import key

HOLD = 1_000_000
LIMIT_ID = 41


class StorageContract:
    @pytest.fixture
    def storage_url(self, request, tmp_path) -> str:
        raise NotImplementedError("each database's subclass provides a migrated database")

    @pytest.fixture
    def engine(self, storage_url) -> Engine:
        engine = make_engine(storage_url)
        yield engine
        engine.dispose()

    @pytest.fixture
    def storage(self, engine) -> Storage:
        return storage_of(engine)

    @pytest.fixture
    def customer(self, engine) -> int:
        with engine.begin() as conn:
            return create_account(conn, cmd.CUSTOMER, "customer")

    @pytest.fixture
    def counter(self, engine) -> int:
        """The other side of the test's postings: an account the storage's rules never look at."""
        with engine.begin() as conn:
            return create_system_account(conn, "test:counter", "counter")

    # Engines
    def test_the_engine_is_made_by_the_storage_its_url_names(self, storage_url, engine, storage):
        url = make_url(storage_url)
        assert storage.engine_url(url).drivername == engine.url.drivername
        assert make_url(storage_url).get_backend_name() in storage.url_backends
        assert engine.dialect.name == storage.dialect

    def test_a_url_that_cannot_hold_a_ledger_is_refused(self, storage_url, storage):
        with pytest.raises(BadDatabaseUrl):
            storage.engine_url(make_url(storage_url).set(database=""))

    def test_a_unique_key_another_process_took_is_transient_a_broken_rule_is_not(self, engine, storage):
        unique = self._error(engine, insert(ledger_head).values(id=1, last_seq=0, last_hash=GENESIS_HASH))
        not_null = self._error(engine, insert(accounts).values(kind=cmd.CUSTOMER, name=None, created_at=utc_now()))
        assert storage.is_transient(unique)
        assert not storage.is_transient(not_null)

    @staticmethod
    def _error(engine: Engine, statement) -> DBAPIError:
        with pytest.raises(DBAPIError) as raised, engine.begin() as conn:
            conn.execute(statement)
        return raised.value

    # Reads
    @pytest.mark.parametrize("count", [0, 1, 3])
    def test_one_of_selects_exactly_the_values_given(self, engine, storage, count):
        with engine.begin() as conn:
            ids = [create_account(conn, cmd.OWNER, f"owner {i}") for i in range(count + 2)][:count]
            by_id = conn.execute(select(accounts.c.id).where(storage.one_of(accounts.c.id, ids))).scalars().all()
            names = [f"owner {i}" for i in range(count)]
            by_name = conn.execute(select(accounts.c.id).where(storage.one_of(accounts.c.name, names))).scalars().all()
        assert sorted(by_id) == sorted(by_name) == sorted(ids)

    def test_the_locked_read_sees_the_head_the_keys_and_the_balances(self, engine, storage, customer, counter):
        with engine.begin() as conn:
            head = storage.lock_head_and_read(conn, ["k-1", "missing"], [customer])
            assert (head.last_seq, head.last_hash, head.known_keys, head.balances) == (0, GENESIS_HASH, {}, {customer: 0})
            storage.write_appended(conn, self._batch(customer, counter, seq=1, key_="k-1", amount=5))
        with engine.begin() as conn:
            head = storage.lock_head_and_read(conn, ["k-1", "missing"], [customer])
            assert (head.last_seq, head.last_hash) == (1, b"h" * 32)
            assert head.known_keys == {"k-1": (b"d" * 32, 1, "CreditsGranted")} == storage.read_known_keys(conn, ["k-1"])
            assert head.balances == {customer: 5} == storage.read_balances(conn, [customer])

    # Appends
    def test_a_decided_batch_is_written_whole(self, engine, storage, customer, counter):
        with engine.begin() as conn:
            spend_limits.create_limit(conn, LIMIT_ID, 10 * HOLD)
            storage.add_holds_placed(conn, {customer: 5})  # what closes was placed first (PostgreSQL's guard checks it)
            storage.add_limit_placed(conn, {LIMIT_ID: 5})
            batch = self._batch(customer, counter, seq=1, key_="k-1", amount=7)
            storage.write_appended(conn, batch._replace(holds_closed={customer: 3}, limit_usage={LIMIT_ID: (2, 3)}))
        with engine.connect() as conn:
            event = conn.execute(select(ledger_events)).one()
            postings = conn.execute(select(ledger_postings.c.leg, ledger_postings.c.account_id,
                                           ledger_postings.c.amount_nano_usd)).all()
            books = read_books(conn, [customer, counter])
            limit = spend_limits.read_limits(conn, [LIMIT_ID])[LIMIT_ID]
            head = conn.execute(select(ledger_head.c.last_seq, ledger_head.c.last_hash)).one()
        assert (event.seq, event.idempotency_key, event.payload, event.recorded_at) == (1, "k-1", '{"x":1}', batch.recorded_at)
        assert sorted(postings) == [(0, customer, 7), (1, counter, -7)]
        assert (books[customer].balance_nano_usd, books[customer].held_nano_usd, books[customer].last_event_seq) == (7, 2, 1)
        assert (books[counter].balance_nano_usd, books[counter].last_event_seq) == (-7, 1)
        assert (limit["spent_nano_usd"], limit["held_nano_usd"]) == (2, 2)
        assert tuple(head) == (1, b"h" * 32)

    @staticmethod
    def _batch(account: int, counter: int, *, seq: int, key_: str, amount: int) -> AppendedBatch:
        """One event moving `amount` into `account` from `counter`, both balances starting at zero
        (the storage checks no rule; on PostgreSQL the postings themselves move the balances)."""
        event = ("CreditsGranted", '{"x":1}', key_, b"d" * 32, None)
        postings = [(account, amount), (counter, -amount)]
        return AppendedBatch([event], [postings], [GENESIS_HASH, b"h" * 32], {account: amount, counter: -amount}, {}, {}, seq, utc_now())

    # Holds
    def test_placement_answers_alike_on_every_storage(self, engine, customer):
        assert _placement(engine, customer, hl.place_holds) == PLACEMENT_ANSWERS

    def test_placement_records_the_replica_that_placed_each_hold(self, engine, customer):
        append_now(engine, cmd.GrantCredits(customer, 10 * HOLD, "credits", key("grant")))
        with engine.begin() as conn:
            placed = hl.place_holds(conn, [PlaceHold(customer, HOLD, "hold-a", replica_id="host-a:8000"),
                                           PlaceHold(customer, HOLD, "hold-b", replica_id="host-b:8000"),
                                           PlaceHold(customer, HOLD, "hold-c")])
        with engine.connect() as conn:
            assert set(hl.holds_of_replica(conn, "host-a:8000")) == {placed[0].hold_id}
            assert dict(conn.execute(select(holds.c.idempotency_key, holds.c.replica_id)).all()) == {
                "hold-a": "host-a:8000", "hold-b": "host-b:8000", "hold-c": None}

    def test_holds_inserted_get_their_ids_and_expiry(self, engine, storage, customer):
        now = utc_now()
        with engine.begin() as conn:
            ids = storage.insert_holds(conn, [(customer, 5, "h-1", 60, None, None), (customer, 6, "h-2", 1, LIMIT_ID, "host:8000")],
                                       now)
            rows = {r.idempotency_key: r for r in conn.execute(select(holds))}
        assert set(ids) == {"h-1", "h-2"} and {rows[k].id for k in ids} == set(ids.values())
        assert rows["h-1"].expires_at == now + timedelta(seconds=60) and rows["h-2"].spend_limit_id == LIMIT_ID
        assert (rows["h-1"].replica_id, rows["h-2"].replica_id) == (None, "host:8000")
        with engine.begin() as conn:
            assert storage.insert_holds(conn, [], now) == {}

    def test_a_renewal_pushes_the_expiry_and_records_a_capture_never_lowered_nor_above_the_hold(self, engine, storage, customer):
        now = utc_now()
        with engine.begin() as conn:
            ids = storage.insert_holds(conn, [(customer, 10, "h-1", 1, None, None)], now)
            hold_id = ids["h-1"]
            renewed = storage.renew_holds(conn, [HoldRenewal(hold_id, 60, 4, 7, "r-1", {}), HoldRenewal(hold_id + 99, 60)],
                                          ['{"a":1}', None], now)
            assert renewed == {hold_id}, "a hold that is gone is not renewed"
            storage.renew_holds(conn, [HoldRenewal(hold_id, 30, 2, 8, "r-2", {})], ['{"a":2}'], now)
            lowered = conn.execute(select(holds).where(holds.c.id == hold_id)).one()
            storage.renew_holds(conn, [HoldRenewal(hold_id, 30, 50, 8, "r-2", {})], ['{"a":3}'], now)
            capped = conn.execute(select(holds.c.capture_nano_usd)).scalar()
            storage.renew_holds(conn, [HoldRenewal(hold_id, 90)], [None], now)
            plain = conn.execute(select(holds).where(holds.c.id == hold_id)).one()
        assert (lowered.expires_at, lowered.capture_nano_usd) == (now + timedelta(seconds=30), 4), "never lowered"
        assert (lowered.capture_owner_account_id, lowered.capture_request_id, lowered.capture_meta) == (8, "r-2", '{"a":2}')
        assert capped == 10, "never above the hold"
        assert (plain.expires_at, plain.capture_nano_usd, plain.capture_meta) == (now + timedelta(seconds=90), 10, '{"a":3}')

    def test_closed_holds_come_back_whole_when_reopened(self, engine, storage, customer):
        # Placed and renewed in a transaction of their own, as the holds' writer does before any settlement closes them.
        with engine.begin() as conn:
            # Texts that quoting gets wrong: a row's fields come back whole however it travels.
            awkward = 'h-1, "(x)\\\t{y}'
            now = utc_now()
            ids = storage.insert_holds(conn, [(customer, 5, awkward, 60, LIMIT_ID, "host:8000"), (customer, 6, "h-2", 60, None, None)], now)
            storage.renew_holds(conn, [HoldRenewal(ids[awkward], 60, 4, 8, 'r "1", (2)', {})], ['{"q":"a\\"b,(c)"}'], now)
        with engine.begin() as conn:
            before = {tuple(r) for r in conn.execute(select(*(holds.c[name] for name in HOLD_ROW)))}
            closed = storage.close_holds(conn, sorted(ids.values()) + [max(ids.values()) + 99])
            assert {c[:4] for c in closed} == {(r[0], r[1], r[2], r[HOLD_ROW.index("spend_limit_id")]) for r in before}
            assert conn.execute(select(func.count()).select_from(holds)).scalar() == 0
            storage.reopen_holds(conn, closed)
            assert {tuple(r) for r in conn.execute(select(*(holds.c[name] for name in HOLD_ROW)))} == before
            assert storage.close_holds(conn, []) == []

    def test_reservation_counters_add_up(self, engine, storage, customer):
        with engine.begin() as conn:
            spend_limits.create_limit(conn, LIMIT_ID, 100)
            storage.add_holds_placed(conn, {customer: 9})
            storage.add_holds_closed(conn, {customer: 4})
            storage.add_limit_placed(conn, {LIMIT_ID: 30})
            storage.add_limit_usage(conn, {LIMIT_ID: (5, 10)})
            storage.add_limit_closed(conn, {LIMIT_ID: 7})
            for add in (storage.add_holds_placed, storage.add_holds_closed, storage.add_limit_placed,
                        storage.add_limit_usage, storage.add_limit_closed):
                add(conn, {})  # nothing to add: nothing written
        with engine.connect() as conn:
            placed = conn.execute(select(customer_holds.c.holds_placed_nano_usd)).scalar()
            held = read_books(conn, [customer])[customer].held_nano_usd
            limit = spend_limits.read_limits(conn, [LIMIT_ID])[LIMIT_ID]
        assert (placed, held) == (9, 5)
        assert limit == {"limit_nano_usd": 100, "spent_nano_usd": 5, "held_nano_usd": 13, "available_nano_usd": 82}


# A customer with 10 HOLD available and a spend limit of 4 HOLD; what each request gets.
PLACEMENT_REQUESTS = [
    ("a", 3 * HOLD, None, None),
    ("a", 3 * HOLD, None, None),  # the same key again in the batch: answered like the first
    ("b", 20 * HOLD, None, None),  # more than is available
    ("c", 20 * HOLD, 2 * HOLD, None),  # clamped to what is available, at least the minimum
    ("d", HOLD, None, None),  # nothing left
    ("e", HOLD, None, "unknown"),
    ("f", HOLD, None, "owner"),
]
PLACEMENT_ANSWERS = [
    ("created", 3 * HOLD), ("exists", 3 * HOLD), ("overdraft", None), ("created", 7 * HOLD), ("overdraft", None),
    ("unknown_account", None), ("wrong_account_kind", None),
    # a second batch: a key placed before, the same content and other content; a spend limit
    ("exists", 3 * HOLD), ("exists_with_different_content", None), ("created", HOLD), ("spend_limit_reached", None),
]


def _placement(engine: Engine, customer: int, place) -> list[tuple]:
    """PLACEMENT_REQUESTS, then a second batch, placed by `place(conn, requests)`; each answer as (status or code, amount)."""
    append_now(engine, cmd.GrantCredits(customer, 10 * HOLD, "credits", key("grant")))
    with engine.begin() as conn:
        owner = create_account(conn, cmd.OWNER, "owner")
        spend_limits.create_limit(conn, LIMIT_ID, HOLD + HOLD // 2)
    account_of = {None: customer, "unknown": customer + 1000, "owner": owner}
    first = [PlaceHold(account_of[who], amount, f"hold-{name}", minimum_nano_usd=minimum)
             for name, amount, minimum, who in PLACEMENT_REQUESTS]
    with engine.begin() as conn:
        answers = place(conn, first)
    append_now(engine, cmd.GrantCredits(customer, 2 * HOLD, "more credits", key("grant")))
    second = [first[0], PlaceHold(customer, 2 * HOLD, "hold-a"),
              PlaceHold(customer, HOLD, "hold-g", spend_limit_id=LIMIT_ID),
              PlaceHold(customer, HOLD, "hold-h", spend_limit_id=LIMIT_ID)]
    with engine.begin() as conn:
        answers += place(conn, second)
    return [(a.status, a.amount_nano_usd) if isinstance(a, hl.HoldResult) else (a.code, None) for a in answers]
