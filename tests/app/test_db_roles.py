"""The service's database role (PostgreSQL): it owns nothing, so it cannot
switch off the ledger's triggers, and no balance moves without its event."""
from __future__ import annotations

import logging

import httpx

import openai
import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from app import outbox
from app.anchoring import file as anchor_file
from app.cli import main
from app.jobs.celery import celery
from app.db_roles import NARROW_PRIVILEGES, require_no_create, grant_app_role, service_role
from app.http.status import metrics_registry
from app.jobs.ledger_check import run_verification
from app.settings import Settings, SettingsError
from invoices.service import list_invoices
from invoices.tasks import ISSUE_INVOICE, PROJECT_READ_MODELS
from ledger import commands as cmd
from ledger.anchors import Anchor, read_head
from ledger.db import make_engine, snapshot_connection
from ledger.errors import BadDatabaseUrl, InvalidInput
from ledger.holds import PlaceHold
from ledger.limits import INT64_MAX
from ledger.service import Ledger, append_now
from ledger.schema import utc_now
from ledger.verify import rebuild_balances, verify
from prometheus_client import generate_latest
from tests.ledger.helpers import customer_with, key, money_snapshot
from tests.support.celery_worker import celery_worker  # noqa: F401 (a fixture)
from tests.support.db_roles import APP_ROLE, app_role_url
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for
from tests.support.tampering import tamper_as_superuser

USD = 10**9
THOUSAND_USD = 1000 * USD

# What someone holding the service's credentials might try; each must fail with nothing moved.
TAMPERING = [
    "ALTER TABLE ledger_events DISABLE TRIGGER ALL",
    "ALTER TABLE account_balances DISABLE TRIGGER ALL",
    "DROP TRIGGER account_balances_guard ON account_balances",
    f"UPDATE account_balances SET balance_nano_usd = balance_nano_usd + {THOUSAND_USD} WHERE account_id = :customer",
    f"UPDATE account_balances SET balance_nano_usd = balance_nano_usd + {THOUSAND_USD}, "
    "last_event_seq = last_event_seq + 1 WHERE account_id = :customer",
    f"UPDATE account_balances SET holds_closed_nano_usd = holds_closed_nano_usd + {THOUSAND_USD} WHERE account_id = :customer",
    f"UPDATE customer_holds SET holds_placed_nano_usd = holds_placed_nano_usd - {USD} WHERE account_id = :customer",
    f"INSERT INTO account_balances (account_id, balance_nano_usd) SELECT id, {THOUSAND_USD} FROM accounts WHERE id = :customer",
    "UPDATE ledger_events SET payload = payload WHERE seq = 1",
    "DELETE FROM ledger_events WHERE seq = 1",
    "DELETE FROM ledger_postings",
    "TRUNCATE ledger_events CASCADE",
    "SET session_replication_role = replica",
    "DELETE FROM account_balances WHERE account_id = :customer",
    "UPDATE account_balances SET last_event_seq = 9223372036854775807 WHERE account_id = :customer",
]


@pytest.fixture
def books(postgres_url):
    """A customer with $10 and a hold of $1, the service's engine, and the owner's."""
    owner = make_engine(postgres_url)
    ledger = Ledger(owner)
    customer = customer_with(ledger, 10 * USD)
    ledger.place_hold(PlaceHold(customer, USD, key("hold")))
    service = make_engine(app_role_url(postgres_url))
    yield owner, service, customer
    service.dispose()
    ledger.close()
    owner.dispose()


@pytest.mark.parametrize("statement", TAMPERING)
def test_the_service_role_cannot_move_money_without_an_event_nor_switch_the_guards_off(books, statement):
    owner, service, customer = books
    before = money_snapshot(owner)
    with pytest.raises(DBAPIError):
        with service.begin() as conn:
            conn.execute(text(statement), {"customer": customer} if ":customer" in statement else {})
    assert money_snapshot(owner) == before
    with owner.connect() as conn:
        assert conn.execute(text("SELECT balance_nano_usd FROM account_balances WHERE account_id = :c"),
                            {"c": customer}).scalar_one() == 10 * USD
    with snapshot_connection(owner) as conn:
        assert verify(conn).ok


def _refused_and_nothing_moved(owner, service, statements, customer, match, balance_nano_usd=10 * USD):
    before = money_snapshot(owner)
    with pytest.raises(DBAPIError, match=match):
        with service.begin() as conn:
            for statement in statements:
                conn.execute(text(statement), {"c": customer})
    assert money_snapshot(owner) == before
    assert money_snapshot(owner)["balances"][customer] == balance_nano_usd
    with owner.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ledger_postings WHERE account_id = :c AND amount_nano_usd = :a"),
                            {"c": customer, "a": THOUSAND_USD}).scalar_one() == 0
    with snapshot_connection(owner) as conn:
        assert verify(conn).ok
    assert run_verification(service)["ok"]


def test_a_posting_of_no_event_is_refused_at_insert(books):
    """The service may insert postings (appends do), but only beside the event it inserts with them."""
    owner, service, customer = books
    _refused_and_nothing_moved(owner, service, [
        f"INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd) VALUES (1000000, 0, :c, {THOUSAND_USD})",
    ], customer, "names no event this transaction inserted")


def test_a_posting_on_an_old_event_is_refused_and_so_the_balance_edit_after_it(books):
    """A posting attached to an event already in the log would let a balance move over that
    event's range past the balance guard, unseen by the incremental verification. An idle
    customer (no event yet) is the one whose balance range (0, 1] would take it."""
    owner, service, _ = books
    ledger = Ledger(owner)
    idle = ledger.create_account(cmd.CUSTOMER, "idle")
    ledger.close()
    attach = (f"INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd) "
              f"VALUES (1, 99, :c, {THOUSAND_USD})")
    _refused_and_nothing_moved(owner, service, [
        attach,
        f"UPDATE account_balances SET balance_nano_usd = balance_nano_usd + {THOUSAND_USD}, last_event_seq = 1 "
        "WHERE account_id = :c",
    ], idle, "names no event this transaction inserted", balance_nano_usd=0)
    _refused_and_nothing_moved(owner, service, [attach], idle, "names no event this transaction inserted", balance_nano_usd=0)


def test_postings_of_a_new_event_must_sum_to_zero(books):
    """Even beside its own new event, a posting that makes money from nothing is refused."""
    owner, service, customer = books
    with owner.connect() as conn:
        head = conn.execute(text("SELECT last_seq, last_hash FROM ledger_head")).one()
    _refused_and_nothing_moved(owner, service, [
        _forged_event(head),
        f"INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd) "
        f"VALUES ({head.last_seq + 1}, 0, :c, {THOUSAND_USD})",
    ], customer, "sum to 1000000000000 nano-USD, not 0")


def test_a_new_events_postings_are_summed_per_statement(books):
    """The guard sums each statement's own postings: an event's legs split over
    two statements that do not each sum to zero are refused at the first."""
    owner, service, customer = books
    with owner.connect() as conn:
        head = conn.execute(text("SELECT last_seq, last_hash FROM ledger_head")).one()
        platform = conn.execute(text("SELECT id FROM accounts WHERE system_code = 'platform:revenue'")).scalar_one()
    seq = head.last_seq + 1
    _refused_and_nothing_moved(owner, service, [
        _forged_event(head),
        f"INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd) VALUES ({seq}, 0, :c, {THOUSAND_USD})",
        f"INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd) VALUES ({seq}, 1, {platform}, -{THOUSAND_USD})",
    ], customer, "sum to 1000000000000 nano-USD, not 0")


def test_a_head_moved_ahead_cannot_make_a_balance_skip_a_debit(books):
    """The head is the service's to move. An event paying the customer $1, the head moved past
    it (in a savepoint), then an event taking the dollar back: a guard summing each balance's
    range of the log could be made to apply the debit alone. The balances move with each
    statement's own postings instead (migration 0030), so they follow both events whatever the
    head says, and the service's role cannot write a balance itself."""
    owner, service, customer = books
    with owner.connect() as conn:
        head = conn.execute(text("SELECT last_seq, last_hash FROM ledger_head")).one()
        platform = conn.execute(text("SELECT id FROM accounts WHERE system_code = 'platform:revenue'")).scalar_one()
    paid, taken = head.last_seq + 1, head.last_seq + 2
    legs = "INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd) VALUES ({seq}, 0, :c, {c}), ({seq}, 1, {p}, {p_})"
    balances = text("SELECT account_id, balance_nano_usd FROM account_balances WHERE account_id IN (:c, :p)")
    before = money_snapshot(owner)
    with service.connect() as conn:
        with conn.begin() as transaction:
            for statement in [
                _forged_event(head),
                legs.format(seq=paid, c=USD, p=platform, p_=-USD),
                "SAVEPOINT ahead",
                f"UPDATE ledger_head SET last_seq = {paid} WHERE id = 1",
                "RELEASE SAVEPOINT ahead",
            ]:
                conn.execute(text(statement), {"c": customer})
            after_paid = dict(conn.execute(balances, {"c": customer, "p": platform}).all())
            conn.execute(text(f"INSERT INTO ledger_events (seq, event_type, payload, idempotency_key, content_digest, "
                              f"prev_hash, hash, recorded_at) VALUES ({taken}, 'CreditsGranted', '{{}}', 'forged again', "
                              f"'\\x00', '\\x00', '\\x00', now())"))
            conn.execute(text(legs.format(seq=taken, c=-USD, p=platform, p_=USD)), {"c": customer})
            after_taken = dict(conn.execute(balances, {"c": customer, "p": platform}).all())
            transaction.rollback()
    assert after_paid == {customer: 11 * USD, platform: before["balances"][platform] - USD}
    assert after_taken == {customer: 10 * USD, platform: before["balances"][platform]}
    assert money_snapshot(owner) == before


_LEVER = [  # a trigger of the service's own, moving a balance from inside it
    "CREATE TEMPORARY TABLE lever (pulled int)",
    f"CREATE FUNCTION pg_temp.pull() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN UPDATE account_balances "
    f"SET balance_nano_usd = balance_nano_usd + {THOUSAND_USD} WHERE account_id = current_setting('lever.account')::bigint; "
    "RETURN NULL; END $$",
    "CREATE TRIGGER pull AFTER INSERT ON lever FOR EACH STATEMENT EXECUTE FUNCTION pg_temp.pull()",
    "SELECT set_config('lever.account', CAST(:c AS text), true)",
    "INSERT INTO lever VALUES (1)",
]
# Temporary tables named like what a guard reads: looked up before pg_catalog
# and the schema unless the guard's search path puts them last.
_SHADOWS = {
    "pg_class, to pass for the balances' owner": [
        "CREATE TEMPORARY TABLE pg_class (oid oid, relowner oid)",
        "INSERT INTO pg_temp.pg_class SELECT CAST('account_balances' AS regclass), oid FROM pg_catalog.pg_roles "
        "WHERE rolname = current_user",
        *_LEVER,
    ],
    "customer_holds, to close more holds than were placed": [
        "CREATE TEMPORARY TABLE customer_holds (account_id bigint, holds_placed_nano_usd bigint)",
        f"INSERT INTO pg_temp.customer_holds VALUES (:c, {2 * THOUSAND_USD})",
        f"UPDATE account_balances SET holds_closed_nano_usd = holds_closed_nano_usd + {THOUSAND_USD} WHERE account_id = :c",
    ],
}


@pytest.mark.parametrize("shadow", list(_SHADOWS))
def test_a_temporary_table_of_the_services_own_cannot_stand_in_for_what_a_guard_reads(books, shadow):
    owner, service, customer = books
    _refused_and_nothing_moved(owner, service, _SHADOWS[shadow], customer, "without the events that cause it")


def test_the_postings_function_runs_for_ledger_postings_alone(books):
    """It runs as its owner (migration 0030): attached to a table of the caller's own, whose
    rows and column types the caller chooses, it would move any balance and run the caller's
    casts as the owner. No one may execute it; and granted that right anyway, it refuses."""
    owner, service, customer = books
    with owner.connect() as conn:
        head = conn.execute(text("SELECT last_seq, last_hash FROM ledger_head")).one()
        platform = conn.execute(text("SELECT id FROM accounts WHERE system_code = 'platform:revenue'")).scalar_one()
    seq = head.last_seq + 1
    attach = [
        "CREATE TEMPORARY TABLE fake (event_seq bigint, leg int, account_id bigint, amount_nano_usd bigint)",
        "CREATE TRIGGER fake_guard AFTER INSERT ON fake REFERENCING NEW TABLE AS new_postings "
        "FOR EACH STATEMENT EXECUTE FUNCTION paralon_guard_postings()",
        _forged_event(head),
        f"INSERT INTO fake VALUES ({seq}, 0, :c, {THOUSAND_USD}), ({seq}, 1, {platform}, -{THOUSAND_USD})",
    ]
    _refused_and_nothing_moved(owner, service, attach, customer, "permission denied for function paralon_guard_postings")
    with owner.begin() as conn:
        conn.execute(text(f'GRANT EXECUTE ON FUNCTION paralon_guard_postings() TO "{APP_ROLE}"'))
    _refused_and_nothing_moved(owner, service, attach, customer, "runs only after inserts into ledger_postings")


def test_the_service_role_cannot_create_objects_in_the_schema(books, postgres_url):
    """An operator of the service's own with the exact types of a guard's expression would be
    chosen over pg_catalog's (PostgreSQL before 15 let everyone create in `public`)."""
    owner, service, customer = books
    with owner.begin() as conn:
        conn.execute(text(f'GRANT CREATE ON SCHEMA public TO PUBLIC, "{APP_ROLE}"'))
    grant_app_role(owner, APP_ROLE)
    _refused_and_nothing_moved(owner, service, [
        "CREATE FUNCTION public.plus(bigint, numeric) RETURNS numeric LANGUAGE sql AS 'SELECT 0'",
    ], customer, "permission denied for schema public")


def test_granting_refuses_a_role_that_could_still_create_in_the_schema(books):
    """Where the migration's role does not own the schema its revoke does nothing; then
    granting stops, naming what its owner must revoke."""
    owner, _, _ = books
    with owner.begin() as conn:
        conn.execute(text(f'GRANT CREATE ON SCHEMA public TO "{APP_ROLE}"'))
        with pytest.raises(InvalidInput, match="may create objects in schema 'public'"):
            require_no_create(conn, APP_ROLE, "public")


def test_an_operator_made_in_the_schema_is_never_picked_by_the_postings_function(books):
    """The function runs as its owner and sees pg_catalog and temporary objects only: even an
    operator with the exact types of one of its expressions, in the schema, is not used."""
    owner, service, customer = books
    with owner.begin() as conn:
        conn.execute(text("CREATE FUNCTION public.hijacked(numeric, integer) RETURNS boolean LANGUAGE plpgsql "
                          "AS $$ BEGIN RAISE EXCEPTION 'hijacked'; END $$"))
        conn.execute(text("CREATE OPERATOR public.<> (LEFTARG = numeric, RIGHTARG = integer, FUNCTION = public.hijacked)"))
        conn.execute(text("CREATE FUNCTION public.hijacked_oid(oid, regclass) RETURNS boolean LANGUAGE plpgsql "
                          "AS $$ BEGIN RAISE EXCEPTION 'hijacked'; END $$"))
        conn.execute(text("CREATE OPERATOR public.<> (LEFTARG = oid, RIGHTARG = regclass, FUNCTION = public.hijacked_oid)"))
    ledger = Ledger(service)
    try:
        ledger.append(cmd.GrantCredits(customer, USD, "more", key()))
    finally:
        ledger.close()
    assert money_snapshot(owner)["balances"][customer] == 11 * USD


def test_after_migrating_every_function_reads_pg_catalog_first_and_no_trigger_function_can_be_called(books):
    """What `app.db_roles.harden_functions` leaves after each migration, whatever a
    migration's CREATE OR REPLACE dropped."""
    owner, _, _ = books
    with owner.connect() as conn:
        functions = conn.execute(text(
            "SELECT p.proname, p.proconfig, p.prorettype = CAST('trigger' AS regtype), "
            "has_function_privilege('public', p.oid, 'EXECUTE'), p.prosecdef FROM pg_proc p "
            "WHERE p.pronamespace = CAST(current_schema() AS regnamespace) AND p.prokind = 'f'")).all()
    assert len(functions) > 5
    for name, config, is_trigger, public_may_execute, runs_as_owner in functions:
        path = "pg_catalog, pg_temp" if runs_as_owner else "pg_catalog, public, pg_temp"
        assert f"search_path={path}" in (config or []), name
        assert not (is_trigger and public_may_execute), name


def test_a_posting_to_an_account_without_a_balance_is_refused(books):
    """Every account is created with its balance; one inserted without it (the
    service may insert accounts) cannot take a posting, or the money posted to
    it would leave the sum of the balances."""
    owner, service, customer = books
    with owner.connect() as conn:
        head = conn.execute(text("SELECT last_seq, last_hash FROM ledger_head")).one()
    with service.begin() as conn:
        bare = conn.execute(text("INSERT INTO accounts (kind, name, created_at) VALUES ('customer', 'bare', now()) "
                                 "RETURNING id")).scalar_one()
    before = money_snapshot(owner)
    seq = head.last_seq + 1
    with pytest.raises(DBAPIError, match=f"account {bare} has no balance to post to"):
        with service.begin() as conn:
            conn.execute(text(_forged_event(head)))
            conn.execute(text(f"INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd) "
                              f"VALUES ({seq}, 0, :c, -{USD}), ({seq}, 1, {bare}, {USD})"), {"c": customer})
    assert money_snapshot(owner) == before


def _forged_event_with_legs(head, accounts: str, amounts: str) -> str:
    """The next event of the chain carrying its postings in its row (migration 0031)."""
    return (f"INSERT INTO ledger_events (seq, event_type, payload, idempotency_key, content_digest, prev_hash, hash, "
            f"recorded_at, posting_account_ids, posting_amounts_nano_usd) VALUES ({head.last_seq + 1}, 'CreditsGranted', "
            f"'{{}}', 'forged', '\\x00', '\\x{bytes(head.last_hash).hex()}', '\\x00', now(), {accounts}, {amounts})")


def _head_and_platform(owner):
    with owner.connect() as conn:
        head = conn.execute(text("SELECT last_seq, last_hash FROM ledger_head")).one()
        platform = conn.execute(text("SELECT id FROM accounts WHERE system_code = 'platform:revenue'")).scalar_one()
    return head, platform


@pytest.mark.parametrize("amounts, total", [
    ([THOUSAND_USD, -1], THOUSAND_USD - 1),
    ([THOUSAND_USD, -1, 0], THOUSAND_USD - 1),  # three legs, a settlement's number: added in place
    ([1, 0, 0, 0], 1),
    ([INT64_MAX, INT64_MAX, 1], 2 * INT64_MAX + 1),  # three legs out of bigint's range: summed in numeric
    ([-INT64_MAX - 1, -INT64_MAX - 1, 0], -2 * INT64_MAX - 2),
])
def test_legs_in_an_event_row_must_sum_to_zero(books, amounts, total):
    owner, service, customer = books
    head, platform = _head_and_platform(owner)
    accounts = ", ".join([":c", *[str(platform)] * (len(amounts) - 1)])
    _refused_and_nothing_moved(owner, service, [
        _forged_event_with_legs(head, f"ARRAY[{accounts}]", f"ARRAY[{', '.join(map(str, amounts))}]::bigint[]"),
    ], customer, f"postings sum to {total} nano-USD, not 0")


@pytest.mark.parametrize("accounts, amounts", [
    ("ARRAY[:c, {p}]", f"ARRAY[{USD}]"),  # lengths differ
    ("ARRAY[:c, NULL]", f"ARRAY[{USD}, -{USD}]"),  # an account missing
    ("ARRAY[:c, {p}]", f"ARRAY[{USD}, NULL]"),  # an amount missing
    ("CAST('{{}}' AS bigint[])", "CAST('{{}}' AS bigint[])"),  # no leg at all
    ("ARRAY[:c, {p}]", "NULL"),  # accounts without amounts
    ("ARRAY[[:c], [{p}]]", f"ARRAY[[{USD}], [-{USD}]]"),  # two dimensions
])
def test_legs_in_an_event_row_are_two_arrays_of_one_length_without_a_gap(books, accounts, amounts):
    owner, service, customer = books
    head, platform = _head_and_platform(owner)
    _refused_and_nothing_moved(owner, service, [_forged_event_with_legs(head, accounts.format(p=platform), amounts.format())],
                               customer, "ck_ledger_events_posting_arrays")


def test_legs_in_an_event_row_move_the_balances_and_no_posting_row_may_join_them(books):
    """The service's role writes an event with its legs in its row as appends do: the
    balances move in the same statement. A posting row added to that event is refused."""
    owner, service, customer = books
    head, platform = _head_and_platform(owner)
    seq = head.last_seq + 1
    event = _forged_event_with_legs(head, f"ARRAY[:c, {platform}]", f"ARRAY[{USD}, -{USD}]")
    with service.connect() as conn:
        with conn.begin() as transaction:
            conn.execute(text(event), {"c": customer})
            moved = conn.execute(text("SELECT balance_nano_usd, last_event_seq FROM account_balances WHERE account_id = :c"),
                                 {"c": customer}).one()
            transaction.rollback()
    assert tuple(moved) == (11 * USD, seq)
    _refused_and_nothing_moved(owner, service, [
        event, f"INSERT INTO ledger_postings (event_seq, leg, account_id, amount_nano_usd) VALUES ({seq}, 2, :c, 0)",
    ], customer, "its event carries its postings in its row")


def test_legs_in_an_event_row_to_an_account_without_a_balance_are_refused(books):
    owner, service, customer = books
    head, _ = _head_and_platform(owner)
    with service.begin() as conn:
        bare = conn.execute(text("INSERT INTO accounts (kind, name, created_at) VALUES ('customer', 'bare', now()) "
                                 "RETURNING id")).scalar_one()
    before = money_snapshot(owner)
    with pytest.raises(DBAPIError, match=f"account {bare} has no balance to post to"):
        with service.begin() as conn:
            conn.execute(text(_forged_event_with_legs(head, f"ARRAY[:c, {bare}]", f"ARRAY[-{USD}, {USD}]")), {"c": customer})
    assert money_snapshot(owner) == before


def test_the_event_postings_function_runs_for_ledger_events_alone(books):
    """Like the postings guard, it runs as its owner: no one may execute it, and granted
    that right anyway, it refuses to run for any other table."""
    owner, service, customer = books
    head, platform = _head_and_platform(owner)
    attach = [
        "CREATE TEMPORARY TABLE fake (seq bigint, posting_account_ids bigint[], posting_amounts_nano_usd bigint[])",
        "CREATE TRIGGER fake_apply AFTER INSERT ON fake REFERENCING NEW TABLE AS new_events "
        "FOR EACH STATEMENT EXECUTE FUNCTION paralon_apply_event_postings()",
        f"INSERT INTO fake VALUES ({head.last_seq + 1}, ARRAY[:c, {platform}], ARRAY[{THOUSAND_USD}, -{THOUSAND_USD}])",
    ]
    _refused_and_nothing_moved(owner, service, attach, customer, "permission denied for function paralon_apply_event_postings")
    with owner.begin() as conn:
        conn.execute(text(f'GRANT EXECUTE ON FUNCTION paralon_apply_event_postings() TO "{APP_ROLE}"'))
    _refused_and_nothing_moved(owner, service, attach, customer, "runs only after inserts into ledger_events")


def _forged_event(head) -> str:
    """The next event of the chain, written by hand as the service's role could."""
    return (f"INSERT INTO ledger_events (seq, event_type, payload, idempotency_key, content_digest, prev_hash, hash, "
            f"recorded_at) VALUES ({head.last_seq + 1}, 'CreditsGranted', '{{}}', 'forged', '\\x00', "
            f"'\\x{bytes(head.last_hash).hex()}', '\\x00', now())")


def test_the_scheduled_verification_finds_a_posting_added_to_an_old_event(books):
    """Past the postings guard and the balance guard (only the owner can lift them), the balance
    and its postings still agree: the incremental verification finds the event whose postings
    no longer sum to zero."""
    owner, service, _ = books
    ledger = Ledger(owner)
    idle = ledger.create_account(cmd.CUSTOMER, "idle")
    ledger.close()
    assert run_verification(service)["ok"]
    with owner.begin() as conn:
        guards = ("ledger_postings", "ledger_postings_guard"), ("account_balances", "account_balances_guard")
        for table, guard in guards:
            conn.execute(text(f"ALTER TABLE {table} DISABLE TRIGGER {guard}"))
        conn.execute(text(f"INSERT INTO ledger_postings VALUES (1, 99, :c, {THOUSAND_USD})"), {"c": idle})
        conn.execute(text(f"UPDATE account_balances SET balance_nano_usd = balance_nano_usd + {THOUSAND_USD}, "
                          "last_event_seq = 1 WHERE account_id = :c"), {"c": idle})
        for table, guard in guards:
            conn.execute(text(f"ALTER TABLE {table} ENABLE TRIGGER {guard}"))
    result = run_verification(service)
    assert not result["ok"] and result["events_checked"] == 0
    with owner.connect() as conn:
        first = conn.execute(text("SELECT first_problem FROM ledger_verifications")).scalar_one()
    assert first == f"event 1: postings sum to {THOUSAND_USD} nano-USD, not 0"


def test_the_owner_too_cannot_move_a_balance_without_its_event(books):
    """The guard is the database's, not a missing grant: only switching it off (as the owner) gets past it."""
    owner, _, customer = books
    with pytest.raises(DBAPIError, match="without the events that cause it"):
        with owner.begin() as conn:
            conn.execute(text(f"UPDATE account_balances SET balance_nano_usd = balance_nano_usd + {THOUSAND_USD} "
                              "WHERE account_id = :c"), {"c": customer})


def test_the_service_role_moves_money_with_its_events(books):
    """Grants, settlements, holds and releases through the ledger work as the service's role."""
    owner, service, customer = books
    ledger = Ledger(service)
    try:
        gpu_owner = ledger.create_account(cmd.OWNER, "gpu owner")
        ledger.append(cmd.GrantCredits(customer, 2 * USD, "more", key()))
        hold = ledger.place_hold(PlaceHold(customer, USD, key("hold")))
        ledger.append(cmd.SettleRequest(hold.hold_id, gpu_owner, 1_000_000, "r1", key(), {}))
    finally:
        ledger.close()
    assert money_snapshot(owner)["balances"][customer] == 12 * USD - 1_000_000
    with snapshot_connection(owner) as conn:
        assert verify(conn).ok


def test_the_service_role_owns_nothing_and_gets_less_on_the_ledger_tables(books):
    owner, _, _ = books
    with owner.connect() as conn:
        owned = conn.execute(text("SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner "
                                  "WHERE r.rolname = :r"), {"r": APP_ROLE}).scalar_one()
        rights = dict(conn.execute(text(
            "SELECT table_name, string_agg(privilege_type, ',' ORDER BY privilege_type) FROM information_schema.table_privileges "
            "WHERE grantee = :r GROUP BY table_name"), {"r": APP_ROLE}).all())
    assert owned == 0
    assert rights["ledger_events"] == rights["ledger_postings"] == "INSERT,SELECT"
    assert rights["account_balances"] == "INSERT,SELECT", "updates only of the named columns"
    assert rights["holds"] == "DELETE,INSERT,SELECT,UPDATE"
    assert set(NARROW_PRIVILEGES) <= set(rights)


def test_the_full_flow_runs_as_the_service_role(postgres_url, monkeypatch):
    """serve (as the role), a streamed request settled, a crashed replica's hold swept; then beat's
    tasks as the role: the outbox issues an invoice, the read models, the verification."""
    worker = sim_worker("instant")
    fleet = make_fleet(postgres_url, [worker.url], credits_usd="10")
    try:
        with serving(postgres_url, PARALON_HOLD_SWEEP_INTERVAL_MS="200") as proxy:
            assert make_url(proxy.env["PARALON_DATABASE_URL"]).username == APP_ROLE
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0, timeout=30)
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=16, stream=True, stream_options={"include_usage": True})
            usage = [c.usage for c in stream if c.usage][-1]
            orphan = Ledger(fleet.engine).place_hold(PlaceHold(fleet.customer_id, USD, key("orphan"), ttl_s=1))
            assert orphan.status == "created"
            wait_for(lambda: fleet.balance(fleet.customer_id).held_nano_usd == 0, timeout_s=30)
    finally:
        worker.stop()
    [settled] = fleet.settlements()
    assert settled["meta"]["completion_tokens"] == usage.completion_tokens == 16
    purchase = append_now(fleet.engine, cmd.PurchaseCredits(fleet.customer_id, 5 * USD, "card", "stripe:s1", "external:stripe", "s1"))
    with fleet.engine.begin() as conn:
        outbox.add(conn, ISSUE_INVOICE, purchase.seq)
    monkeypatch.setitem(celery.conf, "task_always_eager", True)
    monkeypatch.setenv("PARALON_DATABASE_URL", proxy.env["PARALON_DATABASE_URL"])
    for task in ("paralon.dispatch_outbox", PROJECT_READ_MODELS, "paralon.verify_ledger"):
        celery.tasks[task].apply(throw=True)
    assert [i["source_seq"] for i in list_invoices(fleet.engine, fleet.customer_id)] == [purchase.seq]
    assert fleet.balance(fleet.customer_id).balance_nano_usd == 15 * USD - settled["charge_nano_usd"]
    fleet.assert_books_close()
    fleet.engine.dispose()


def test_migrate_as_the_owner_grants_the_service_role_named_in_its_url(postgres_url):
    app_role_url(postgres_url)  # the role exists
    service_url = make_url(postgres_url).set(username=APP_ROLE).render_as_string(hide_password=False)
    runner = CliRunner()
    env = {"PARALON_DATABASE_URL": service_url, "PARALON_MIGRATION_DATABASE_URL": postgres_url}
    with make_engine(postgres_url).begin() as conn:
        conn.execute(text(f'REVOKE ALL ON ALL TABLES IN SCHEMA public FROM "{APP_ROLE}"'))
    migrated = runner.invoke(main, ["migrate", "--json"], env=env, catch_exceptions=False)
    assert migrated.exit_code == 0, migrated.output
    assert f'"service_role": "{APP_ROLE}"' in migrated.stdout
    created = runner.invoke(main, ["accounts", "create", "--kind", "customer", "--name", "Ada", "--json"], env=env)
    assert created.exit_code == 0, created.output
    assert service_role(service_url, postgres_url) == APP_ROLE and service_role(postgres_url, postgres_url) is None


@pytest.mark.parametrize("role, message", [
    ("bad-name; DROP TABLE x", "must be letters"),
    ("paralon_no_such_role_7f3a", "does not exist"),
    ("postgres", "owns nothing"),
])
def test_grant_app_refuses_a_role_it_cannot_grant_with_one_line(postgres_url, role, message):
    result = CliRunner().invoke(main, ["db", "grant-app", role], env={"PARALON_DATABASE_URL": postgres_url})
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_scheduled_verification_reports_a_tampered_ledger_by_metric_and_error_log(postgres_url, caplog):
    owner = make_engine(postgres_url)
    ledger = Ledger(owner)
    customer = customer_with(ledger, 10 * USD)
    service = make_engine(app_role_url(postgres_url))
    try:
        assert run_verification(service)["ok"]
        assert b"paralon_ledger_verify_ok 1.0" in generate_latest(metrics_registry(service))
        with owner.begin() as conn:  # the owner switches the guard off: only `verify` can tell
            conn.execute(text("ALTER TABLE account_balances DISABLE TRIGGER account_balances_guard"))
            conn.execute(text(f"UPDATE account_balances SET balance_nano_usd = balance_nano_usd + {THOUSAND_USD} "
                              "WHERE account_id = :c"), {"c": customer})
            conn.execute(text("ALTER TABLE account_balances ENABLE TRIGGER account_balances_guard"))
        with caplog.at_level(logging.ERROR, logger="paralon.ledger_verify"):
            result = run_verification(service)
        assert not result["ok"]
        assert any(r.levelno == logging.ERROR and f"differs by {THOUSAND_USD}" in r.getMessage() for r in caplog.records)
        metrics = generate_latest(metrics_registry(service))
        assert b"paralon_ledger_verify_ok 0.0" in metrics and b"paralon_ledger_verify_problems 1.0" in metrics
    finally:
        ledger.close()
        service.dispose()
        owner.dispose()


def test_beat_reports_a_tampered_ledger_on_metrics_and_at_error_level(postgres_url, celery_worker, tmp_path):
    """A real worker with its beat (`paralon worker -B`) verifies every second, as the service's role;
    the owner edits a balance behind the guard; serve's /metrics turns to 0 and the worker logs an ERROR."""
    owner = make_engine(postgres_url)
    ledger = Ledger(owner)
    customer = customer_with(ledger, 10 * USD)
    ledger.close()
    service_url = app_role_url(postgres_url)
    worker = celery_worker({"PARALON_DATABASE_URL": service_url, "PARALON_LEDGER_VERIFY_INTERVAL_S": "1"}, pool="solo",
                           concurrency=1, extra_args=("-B", "--schedule", str(tmp_path / "beat-schedule")))
    try:
        with serving(postgres_url) as proxy:
            def verify_ok() -> bytes | None:
                found = [line for line in httpx.get(proxy.url + "/metrics").content.splitlines()
                         if line.startswith(b"paralon_ledger_verify_ok ")]
                return found[0] if found else None

            assert wait_for(verify_ok, timeout_s=60) == b"paralon_ledger_verify_ok 1.0", worker.log_tail()
            with owner.begin() as conn:
                conn.execute(text("ALTER TABLE account_balances DISABLE TRIGGER account_balances_guard"))
                conn.execute(text(f"UPDATE account_balances SET balance_nano_usd = balance_nano_usd + {THOUSAND_USD} "
                                  "WHERE account_id = :c"), {"c": customer})
                conn.execute(text("ALTER TABLE account_balances ENABLE TRIGGER account_balances_guard"))
            wait_for(lambda: verify_ok() == b"paralon_ledger_verify_ok 0.0", timeout_s=60)
        wait_for(lambda: "ERROR" in worker.log_tail() and "ledger verification FAILED" in worker.log_tail(), timeout_s=30)
        assert f"differs by {THOUSAND_USD}" in worker.log_tail()
    finally:
        owner.dispose()


def test_the_scheduled_verification_proves_only_new_events_and_finds_an_edit_on_each_storage(engine, ledger):
    customer = customer_with(ledger, 10 * USD)
    gpu_owner = ledger.create_account(cmd.OWNER, "gpu owner")
    hold = ledger.place_hold(PlaceHold(customer, USD, key("hold")))
    ledger.append(cmd.SettleRequest(hold.hold_id, gpu_owner, 1_000_000, "r1", key(), {}))
    first = run_verification(engine)
    assert first["ok"] and first["events_checked"] == first["verified_seq"] == 2
    ledger.append(cmd.GrantCredits(customer, USD, "more", key()))
    second = run_verification(engine)
    assert second["ok"] and second["events_checked"] == 1 and second["verified_seq"] == 3
    with engine.begin() as conn:  # a superuser's edit, past the guard on PostgreSQL; SQLite has none
        if engine.dialect.name == "postgresql":
            conn.execute(text("SET LOCAL session_replication_role = replica"))
        conn.execute(text("UPDATE account_balances SET balance_nano_usd = balance_nano_usd + 7 WHERE account_id = :c"),
                     {"c": customer})
    failed = run_verification(engine)
    assert not failed["ok"] and failed["verified_seq"] == 3 and failed["problems_total"] == 1


def test_the_scheduled_verification_finds_a_rewind_below_an_anchor_of_the_file(engine, ledger, tmp_path):
    """Its checkpoint finds a rewind of what it proved; the anchors, one of what it had not proved yet."""
    customer = customer_with(ledger, 10 * USD)
    ledger.append(cmd.GrantCredits(customer, USD, "anchored", key()))
    path = tmp_path / "anchors.jsonl"
    with engine.connect() as conn:
        seq, head_hash = read_head(conn)
    anchor_file.append(path, anchor_file.line_of(Anchor(seq, head_hash, utc_now(), "now")))
    tamper_as_superuser(engine, f"DELETE FROM ledger_postings WHERE event_seq = {seq}")
    tamper_as_superuser(engine, f"DELETE FROM ledger_events WHERE seq = {seq}")
    tamper_as_superuser(engine, f"UPDATE ledger_head SET last_seq = {seq - 1}, "
                                f"last_hash = (SELECT hash FROM ledger_events WHERE seq = {seq - 1})")
    with engine.begin() as conn:
        rebuild_balances(conn)
    with engine.connect() as conn:
        assert verify(conn).ok, "the rewound database agrees with itself"
    failed = run_verification(engine, path)
    assert not failed["ok"] and failed["problems_total"] == 2 and failed["verified_seq"] == 0, failed["problems"]
    assert f"anchored seq {seq}" in failed["problems"][0] and "rewound" in failed["problems"][1]
    assert run_verification(engine)["ok"], "without the anchor file nothing remembers the head"


def test_the_owner_url_defaults_to_the_service_url_and_both_are_checked(monkeypatch):
    monkeypatch.setenv("PARALON_DATABASE_URL", "postgresql://paralon_app@db/paralon")
    monkeypatch.delenv("PARALON_MIGRATION_DATABASE_URL", raising=False)
    assert Settings.from_env().database.owner_url == "postgresql://paralon_app@db/paralon"
    monkeypatch.setenv("PARALON_MIGRATION_DATABASE_URL", "postgresql://paralon_owner@db/paralon")
    assert Settings.from_env().database.owner_url == "postgresql://paralon_owner@db/paralon"
    assert service_role(Settings.from_env().database.url, Settings.from_env().database.owner_url) == "paralon_app"
    monkeypatch.setenv("PARALON_MIGRATION_DATABASE_URL", "mysql://x@db/paralon")
    with pytest.raises(BadDatabaseUrl, match="mysql"):  # as PARALON_DATABASE_URL is checked
        Settings.from_env()
    monkeypatch.delenv("PARALON_MIGRATION_DATABASE_URL")
    monkeypatch.setenv("PARALON_LEDGER_VERIFY_INTERVAL_S", "0")
    with pytest.raises(SettingsError, match="PARALON_LEDGER_VERIFY_INTERVAL_S"):
        Settings.from_env()


def test_replay_as_the_service_role_is_refused_with_one_line_and_moves_nothing(books, postgres_url):
    owner, _, customer = books
    before = money_snapshot(owner)
    result = CliRunner().invoke(main, ["ledger", "replay"], env={"PARALON_DATABASE_URL": app_role_url(postgres_url)})
    assert result.exit_code == 2 and "PARALON_MIGRATION_DATABASE_URL" in result.stderr
    assert money_snapshot(owner) == before
