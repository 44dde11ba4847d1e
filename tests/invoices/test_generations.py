"""The `generations` read model: one row per settled request, the rest charged
after its hold closed added to it, a reversal subtracted, its status from the
settlement's metadata, and the same rows after a rebuild."""
from __future__ import annotations

from sqlalchemy import select

from invoices import read_models
from invoices.schema import generations
from ledger import commands as cmd
from ledger.holds import PlaceHold, settlement_key
from ledger.schema import ledger_events
from ledger.service import Ledger
from proxy.generations import rest_key
from tests.support.harness import make_fleet
from tests.support.previous_release import appending_as_before_0030


def _rows(engine) -> dict[str, dict]:
    with engine.connect() as conn:
        return {r.request_id: dict(r._mapping) for r in conn.execute(select(generations))}


def _settle(ledger: Ledger, fleet, request_id: str, charge: int, meta: dict, *, rest: bool = False) -> int:
    key = settlement_key(request_id)
    hold = ledger.place_hold(PlaceHold(fleet.customer_id, 10**7, f"hold:{key}:{rest}"))
    return ledger.append(cmd.SettleRequest(hold.hold_id, fleet.owner_ids[0], charge, request_id,
                                           rest_key(key) if rest else key, meta)).seq


def _meta(fleet, prompt: int, completion: int, **more) -> dict:
    return {"model": "m-a", "worker_id": fleet.worker_ids[0], "api_key_id": fleet.key_id, "prompt_tokens": prompt,
            "completion_tokens": completion, "started_at": "2026-12-01T00:00:00+00:00", **more}


def test_a_request_is_one_row_its_rest_added_its_reversal_subtracted_and_a_rebuild_the_same(database_url):
    fleet = make_fleet(database_url, ["http://127.0.0.1:1"])
    ledger = Ledger(fleet.engine)
    streamed = _settle(ledger, fleet, "r-streamed", 5_000, _meta(fleet, 10, 20, ttft_ms=42, stream=True, outcome="completed"))
    _settle(ledger, fleet, "r-whole", 3_000, _meta(fleet, 10, 5, ttft_ms=7, stream=False, outcome="completed"))
    _settle(ledger, fleet, "r-left", 1_000, _meta(fleet, 10, 2, ttft_ms=9, stream=True, outcome="cancelled"))
    _settle(ledger, fleet, "r-cut", 1_500, _meta(fleet, 10, 3, ttft_ms=None, stream=True, outcome="failed_mid_stream"))
    _settle(ledger, fleet, "r-old", 2_000, _meta(fleet, 4, 4))  # from before the metadata said more
    read_models.catch_up(fleet.engine)  # the rest lands on another page than its first settlement
    rest = _settle(ledger, fleet, "r-streamed", 700, _meta(fleet, 0, 3, ttft_ms=42, stream=True, outcome="completed"),
                   rest=True)
    read_models.catch_up(fleet.engine)

    rows = _rows(fleet.engine)
    assert {r: rows[r]["status"] for r in rows} == {"r-streamed": "streamed", "r-whole": "completed", "r-left": "cancelled",
                                                    "r-cut": "cancelled", "r-old": "completed"}
    first = rows["r-streamed"]
    assert (first["cost_nano_usd"], first["owner_nano_usd"]) == (5_700, 5_000 * 80 // 100 + 700 * 80 // 100)
    assert (first["prompt_tokens"], first["completion_tokens"], first["ttft_ms"]) == (10, 23, 42)
    assert (first["account_id"], first["api_key_id"], first["worker_id"], first["event_seq"]) == (
        fleet.customer_id, fleet.key_id, fleet.worker_ids[0], rest), "the row's position is the last event that changed it"
    with fleet.engine.connect() as conn:
        settled_at = conn.execute(select(ledger_events.c.recorded_at).where(ledger_events.c.seq == streamed)).scalar_one()
    assert first["completed_at"] == settled_at, "completed when first settled"
    assert rows["r-cut"]["ttft_ms"] is None and rows["r-old"]["ttft_ms"] is None

    reversal = ledger.append(cmd.ReverseEvent(streamed, "refunded a bad answer", "rev-1")).seq
    read_models.catch_up(fleet.engine)
    reversed_row = _rows(fleet.engine)["r-streamed"]
    assert (reversed_row["cost_nano_usd"], reversed_row["completion_tokens"], reversed_row["event_seq"]) == (700, 3, reversal)
    assert reversed_row["owner_nano_usd"] == 700 * 80 // 100 and reversed_row["status"] == "streamed"

    before = _rows(fleet.engine)
    read_models.rebuild(fleet.engine)
    assert _rows(fleet.engine) == before, "a rebuild gives the same rows"
    ledger.close()
    fleet.engine.dispose()


def test_upgrading_fills_the_activity_with_the_requests_settled_before(empty_database_url):
    from alembic import command

    from app.migrate import alembic_config, migrate
    from ledger.accounts import create_account
    from ledger.db import make_engine

    engine = make_engine(empty_database_url)
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0019")  # a deployment from before the activity
        customer, owner = create_account(conn, cmd.CUSTOMER, "early customer"), create_account(conn, cmd.OWNER, "early owner")
    with appending_as_before_0030():
        ledger = Ledger(engine)
        ledger.append(cmd.GrantCredits(customer, 10**9, "before the upgrade", "g-early"))
        hold = ledger.place_hold(PlaceHold(customer, 10**6, "h-early"))
        ledger.append(cmd.SettleRequest(hold.hold_id, owner, 2_000, "r-early", settlement_key("r-early"),
                                        {"model": "m-a", "prompt_tokens": 4, "completion_tokens": 4}))
        ledger.close()
    with engine.begin() as conn:  # its read models caught up, before the table existed
        conn.exec_driver_sql("INSERT INTO consumer_positions (consumer, last_seq, updated_at) VALUES "
                             "('read_models.usage_earnings', 2, CURRENT_TIMESTAMP)")

    migrate(engine)
    assert read_models.lag_events(engine) == 2, "the consumer starts again from the first event"
    read_models.catch_up(engine)
    row = _rows(engine)["r-early"]
    assert (row["account_id"], row["cost_nano_usd"], row["status"], row["ttft_ms"]) == (customer, 2_000, "completed", None)
    engine.dispose()
