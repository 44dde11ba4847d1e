"""Usage and earnings read models: exactly once, identical after a rebuild,
reversals subtracted, lag reported."""
from __future__ import annotations

from click.testing import CliRunner
from sqlalchemy import select

from app.cli import main
from invoices import read_models
from invoices.schema import earnings_daily, usage_daily
from ledger import commands as cmd
from ledger.holds import PlaceHold
from ledger.service import Ledger
from tests.support.harness import make_fleet
from tests.support.previous_release import appending_as_before_0030


def _tables(engine) -> tuple[list, list]:
    with engine.connect() as conn:
        return (sorted(tuple(r) for r in conn.execute(select(usage_daily))),
                sorted(tuple(r) for r in conn.execute(select(earnings_daily))))


def _settle(ledger: Ledger, fleet, i: int, model: str, charge: int) -> int:
    hold = ledger.place_hold(PlaceHold(fleet.customer_id, 10**7, f"h{i}"))
    return ledger.append(cmd.SettleRequest(hold.hold_id, fleet.owner_ids[0], charge, f"r{i}", f"s{i}",
                                           {"model": model, "worker_id": fleet.worker_ids[0], "api_key_id": fleet.key_id,
                                            "prompt_tokens": 10, "completion_tokens": i + 1})).seq


def test_read_models_count_each_settlement_once_and_rebuild_identically(database_url):
    fleet = make_fleet(database_url, ["http://127.0.0.1:1"])
    ledger = Ledger(fleet.engine)
    seqs = [_settle(ledger, fleet, i, "m-a" if i % 2 else "m-b", 1000 + i) for i in range(12)]
    assert read_models.lag_events(fleet.engine) == len(seqs) + 1  # the grant too
    assert read_models.catch_up(fleet.engine) == len(seqs) + 1 and read_models.catch_up(fleet.engine) == 0
    usage, earnings = _tables(fleet.engine)
    assert sum(r[4] for r in usage) == 12 and sum(r[7] for r in usage) == sum(1000 + i for i in range(12))
    assert sum(r[5] for r in earnings) == sum((1000 + i) * 80 // 100 for i in range(12))
    assert fleet.balance(fleet.owner_ids[0]).balance_nano_usd == sum(r[5] for r in earnings), "reconciles with the ledger"

    ledger.append(cmd.ReverseEvent(seqs[0], "refunded a bad answer", "rev"))
    read_models.catch_up(fleet.engine)
    after_reversal = _tables(fleet.engine)
    assert sum(r[4] for r in after_reversal[0]) == 11
    assert fleet.balance(fleet.owner_ids[0]).balance_nano_usd == sum(r[5] for r in after_reversal[1])

    result = CliRunner().invoke(main, ["projections", "rebuild", "--json"], env={"PARALON_DATABASE_URL": database_url})
    assert result.exit_code == 0 and "rebuilding" in result.stderr, result.output
    assert _tables(fleet.engine) == after_reversal, "a rebuild yields identical read models"
    assert read_models.lag_events(fleet.engine) == 0
    ledger.close()
    fleet.engine.dispose()


def test_postings_by_account_keep_every_posting_and_its_text_exactly(database_url):
    from invoices.schema import account_postings
    from ledger.schema import ledger_events, ledger_postings

    fleet = make_fleet(database_url, ["http://127.0.0.1:1"], credits_usd="0")
    awkward = 'goodwill "quoted", {braced}, back\\slash, NULL, ünïcode ✓'
    ledger = Ledger(fleet.engine)
    ledger.append(cmd.GrantCredits(fleet.customer_id, 10**9, awkward, "g-1"))
    _settle(ledger, fleet, 1, 'model "x"', 1234)
    read_models.catch_up(fleet.engine)
    with fleet.engine.connect() as conn:
        copied = sorted((r.event_seq, r.leg, r.account_id, r.amount_nano_usd) for r in conn.execute(select(account_postings)))
        original = sorted((r.event_seq, r.leg, r.account_id, r.amount_nano_usd) for r in conn.execute(select(ledger_postings)))
        grant = conn.execute(select(account_postings).where(account_postings.c.account_id == fleet.customer_id)
                             .order_by(account_postings.c.event_seq)).first()
        settled = conn.execute(select(account_postings.c.model, account_postings.c.reference)
                               .where(account_postings.c.source_type == "RequestSettled")).first()
    assert copied == original, "one row per posting, none lost, none added"
    with fleet.engine.connect() as conn:
        recorded_at = conn.execute(select(ledger_events.c.recorded_at).where(ledger_events.c.seq == grant.event_seq)).scalar_one()
    assert (grant.reference, grant.source_type, grant.recorded_at) == (awkward, "CreditsGranted", recorded_at)
    assert tuple(settled) == ('model "x"', "r1")
    ledger.close()
    fleet.engine.dispose()


def test_upgrading_to_postings_by_account_rebuilds_the_read_models_from_the_first_event(empty_database_url):
    from alembic import command

    from app.migrate import alembic_config, migrate
    from invoices.schema import account_postings
    from ledger.accounts import create_account
    from ledger.db import make_engine
    from ledger.service import append_now

    engine = make_engine(empty_database_url)
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0008")  # a deployment from before statements, its read models caught up
    with engine.begin() as conn:
        customer = create_account(conn, cmd.CUSTOMER, "early customer")
    with appending_as_before_0030():
        append_now(engine, cmd.GrantCredits(customer, 10**9, "before the upgrade", "g-early"))
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO consumer_positions (consumer, last_seq, updated_at) VALUES "
                             "('read_models.usage_earnings', 1, CURRENT_TIMESTAMP)")
    migrate(engine)
    assert read_models.lag_events(engine) == 1, "the consumer starts again"
    read_models.catch_up(engine)
    with engine.connect() as conn:
        assert [(r.account_id, r.amount_nano_usd) for r in conn.execute(
            select(account_postings).where(account_postings.c.account_id == customer))] == [(customer, 10**9)]
    engine.dispose()
