"""An account's postings summed per UTC day and kind (`postings_daily`): the
postings themselves summed, kept by the consumer exactly once, the same after
a rebuild and after the upgrade that fills them; and sums over whole days at
a fixed position equal to those of the postings read one by one.

Events are recorded on several days by setting the clock the ledger stamps
appends with (`ledger.store.utc_now`); nothing else about time is faked."""
from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime

import pytest
from sqlalchemy import func, select

from invoices import posting_sums, read_models
from invoices.schema import account_postings, postings_daily
from ledger import commands as cmd
from ledger.accounts import read_balance
from ledger.errors import InvariantBroken
from ledger.holds import PlaceHold
from ledger.log import consumer_position
from ledger.service import Ledger, append_now
from tests.support.harness import make_fleet

GB = 10**9


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def _daily(engine) -> dict[tuple, tuple[int, int]]:
    with engine.connect() as conn:
        return {(r.account_id, r.day, r.source_type): (r.postings, r.amount_nano_usd) for r in conn.execute(select(postings_daily))}


def _postings_summed(engine) -> dict[tuple, tuple[int, int]]:
    sums: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    with engine.connect() as conn:
        for r in conn.execute(select(account_postings)):
            total = sums[(r.account_id, r.recorded_at.astimezone(UTC).date().isoformat(), r.source_type)]
            total[0], total[1] = total[0] + 1, total[1] + r.amount_nano_usd
    return {key: tuple(value) for key, value in sums.items()}


@pytest.fixture
def history(database_url, monkeypatch):
    """Over three days and a month's end: top-ups, grants, settlements at a day's last and first
    microsecond, and the reversal on a later day of an earlier settlement."""
    clock = {"now": at("2026-10-30T12:00:00")}
    monkeypatch.setattr("ledger.store.utc_now", lambda: clock["now"])
    fleet = make_fleet(database_url, ["http://127.0.0.1:1"])
    ledger = Ledger(fleet.engine)
    c, owner = fleet.customer_id, fleet.owner_ids[0]

    def when(text: str, command) -> int:
        clock["now"] = at(text)
        return append_now(fleet.engine, command).seq

    def settle(text: str, name: str, charge: int) -> int:
        hold = ledger.place_hold(PlaceHold(c, 10**7, f"h-{name}"))
        clock["now"] = at(text)
        return ledger.append(cmd.SettleRequest(hold.hold_id, owner, charge, f"req-{name}", f"s-{name}",
                                               {"model": "m-a", "worker_id": fleet.worker_ids[0], "api_key_id": fleet.key_id,
                                                "prompt_tokens": 10, "completion_tokens": 20})).seq

    when("2026-10-30T13:00:00", cmd.PurchaseCredits(c, 25 * GB, "card", "cs_test_1", "external:stripe", "buy-1"))
    first = settle("2026-10-31T23:59:59.999999", "1", 1_234_567)
    settle("2026-11-01T00:00:00", "2", 2_000_001)
    when("2026-11-01T08:00:00", cmd.GrantCredits(c, 3 * GB, "goodwill", "grant-2"))
    settle("2026-11-02T10:00:00", "3", 777)
    when("2026-11-02T11:00:00", cmd.ReverseEvent(first, "a bad answer", "reverse-1"))
    yield fleet, ledger, clock, settle
    ledger.close()
    fleet.engine.dispose()


def test_the_daily_sums_are_the_postings_summed_once_and_rebuild_identically(history):
    fleet, _, _, _ = history
    read_models.catch_up(fleet.engine)
    assert read_models.catch_up(fleet.engine) == 0
    kept = _daily(fleet.engine)
    assert kept == _postings_summed(fleet.engine)
    assert kept[(fleet.customer_id, "2026-10-31", "RequestSettled")] == (1, -1_234_567)
    assert kept[(fleet.customer_id, "2026-11-02", "RequestSettled")] == (2, 1_234_567 - 777), "the reversal, on its own day"
    read_models.rebuild(fleet.engine)
    assert _daily(fleet.engine) == kept


def test_sums_over_whole_days_at_a_fixed_position_are_those_of_the_postings(history):
    fleet, _, clock, settle = history
    read_models.catch_up(fleet.engine)
    with fleet.engine.connect() as conn:
        through = consumer_position(conn, read_models.CONSUMER)
    settle("2026-11-01T09:00:00", "late", 5_000)  # applied after the position: in neither sum
    read_models.catch_up(fleet.engine)
    periods = [(None, None), (None, at("2026-11-01T00:00:00")), (at("2026-11-01T00:00:00"), at("2026-11-02T00:00:00")),
               (at("2026-10-31T00:00:00"), None), (at("2026-11-01T00:00:00"), at("2026-11-01T08:00:00"))]  # the last: not whole days
    with fleet.engine.connect() as conn:
        for account in (fleet.customer_id, fleet.owner_ids[0]):
            for start, end in periods:
                for position in (through, None):
                    expected = posting_sums._from_postings(conn, account, start, end, position)
                    assert posting_sums.sums_by_kind(conn, account, start, end, position) == expected, (account, start, end, position)
            assert posting_sums.balance_before(conn, account, at("2026-11-03T00:00:00")) == read_balance(conn, account).balance_nano_usd
        at_position = posting_sums.sums_by_kind(conn, fleet.customer_id, at("2026-11-01T00:00:00"), at("2026-11-02T00:00:00"), through)
        assert at_position["RequestSettled"] == (1, -2_000_001), "the late settlement is left out"


def test_upgrading_fills_the_daily_sums_from_the_postings_already_there(history):
    from alembic import command

    from app.migrate import alembic_config, migrate

    fleet, _, _, _ = history
    read_models.catch_up(fleet.engine)
    kept = _daily(fleet.engine)
    config = alembic_config()
    with fleet.engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0022")  # a deployment from before the daily sums, its postings read model caught up
    migrate(fleet.engine)
    assert _daily(fleet.engine) == kept == _postings_summed(fleet.engine)
    assert read_models.lag_events(fleet.engine) == 0, "nothing to apply again"


def test_a_daily_sum_that_disagrees_with_the_ledger_stops_the_month_s_statement(history, tmp_path):
    from app.statement_labels import statement_labels
    from invoices import statements as st
    from invoices.service import InvoiceSettings
    from invoices.schema import statements

    fleet, _, _, _ = history
    read_models.catch_up(fleet.engine)
    october = st.parse_month("2026-10")
    assert st.reconcile(fleet.engine, october.end) == {}
    pd = postings_daily.c
    with fleet.engine.begin() as conn:  # one nano-dollar more in the sums than in the postings and the ledger
        conn.execute(postings_daily.update().where(pd.account_id == fleet.customer_id, pd.day == "2026-10-30",
                                                   pd.source_type == "CreditsPurchased")
                     .values(amount_nano_usd=pd.amount_nano_usd + 1))
    ledger_total = fleet.balance(fleet.customer_id).balance_nano_usd - sum(
        amount for (account, day, _), (_, amount) in _postings_summed(fleet.engine).items()
        if account == fleet.customer_id and day >= "2026-11-01")
    assert st.reconcile(fleet.engine, october.end) == {fleet.customer_id: (ledger_total, ledger_total + 1)}
    settings = InvoiceSettings(tmp_path / "statements")
    with pytest.raises(InvariantBroken, match=str(fleet.customer_id)):
        st.issue(fleet.engine, settings, fleet.customer_id, october, statement_labels, now=at("2026-11-05T00:00:00"))
    with fleet.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(statements)).scalar_one() == 0
