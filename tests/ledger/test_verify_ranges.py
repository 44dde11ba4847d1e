"""`ledger verify` split over processes finds exactly what one process finds:
the same events checked, the same balances, the same problems in the same
order, wherever in the log (and at whichever range's edge) the damage is."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select

from ledger import commands as cmd
from ledger.db import snapshot_connection
from ledger.holds import PlaceHold
from ledger.schema import ledger_events
from ledger.service import Ledger
from ledger.chain import VerifyReport
from ledger.verify import replay_balances, verify
from tests.ledger.helpers import customer_with, keep_granting, key, leg_changed
from tests.support.tampering import tamper_as_superuser

PROCESSES = 2  # one range in this process, one in another
USD = 1_000_000_000


@pytest.fixture
def busy_ledger(pg_engine):
    """Some 30 events: grants, settlements 80/20, a purchase and its refund, on two customers."""
    ledger = Ledger(pg_engine)
    owner = ledger.create_account(cmd.OWNER, "gpu owner")
    customers = [customer_with(ledger, 50 * USD) for _ in range(2)]
    for i in range(25):
        customer = customers[i % 2]
        hold = ledger.place_hold(PlaceHold(customer, USD, key("hold")))
        ledger.append(cmd.SettleRequest(hold.hold_id, owner, 1000 * (i + 1) + 7, f"r{i}", key("settle"), {"model": "m"}))
        if i % 8 == 0:
            ledger.append(cmd.GrantCredits(customer, USD, "top-up", key("grant")))
    ledger.append(cmd.PurchaseCredits(customers[0], 10 * USD, "card", "pi_1", "external:stripe", key("buy")))
    ledger.append(cmd.RefundCredits(customers[0], 10 * USD, "card", "re_1", "external:stripe", key("refund")))
    ledger.close()
    return pg_engine


def _both(engine) -> tuple:
    """What one process and PROCESSES find: problems, counts, refunds and the
    replayed balances (which `verify` also compares with the stored ones)."""
    found = []
    for processes in (1, PROCESSES):
        report = VerifyReport()
        with snapshot_connection(engine) as conn:
            balances = replay_balances(conn, report, processes=processes)
        found.append((report.problems, report.problems_total, report.events_checked, report.refunded_by_account, balances))
    return found[0], found[1]


def _last_seq(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.max(ledger_events.c.seq))).scalar_one()


def test_a_clean_log_checks_the_same_in_one_process_and_in_several(busy_ledger):
    one, several = _both(busy_ledger)
    assert one == several
    assert one[0] == [] and one[2] == _last_seq(busy_ledger) > 30
    with snapshot_connection(busy_ledger) as conn:
        assert verify(conn, processes=PROCESSES).ok


def test_damage_anywhere_is_reported_alike(busy_ledger):
    """Payloads edited in the first range, at both sides of a range's edge and
    in the last event, and a posting changed: the same problems, in the same order."""
    last = _last_seq(busy_ledger)
    edge = last // PROCESSES  # the last event of the first range
    edited = [2, edge, edge + 1, last]
    for seq in edited:
        tamper_as_superuser(busy_ledger, f"UPDATE ledger_events SET payload = payload || ' ' WHERE seq = {seq}")
    tamper_as_superuser(busy_ledger, leg_changed(busy_ledger, last - 1, 0, 3))
    one, several = _both(busy_ledger)
    assert one == several
    for seq in edited:
        assert any(problem.startswith(f"event {seq} ") and "not canonical JSON" in problem for problem in one[0]), (seq, one[0])
    assert any(problem.startswith(f"event {last - 1} ") and "postings sum to 3" in problem for problem in one[0]), one[0]


@pytest.mark.parametrize("edge_offset", [0, 1])
def test_a_missing_event_at_a_range_edge_is_one_gap_in_both(busy_ledger, edge_offset):
    seq = _last_seq(busy_ledger) // PROCESSES + edge_offset
    tamper_as_superuser(busy_ledger, f"DELETE FROM ledger_postings WHERE event_seq = {seq}")
    tamper_as_superuser(busy_ledger, f"DELETE FROM ledger_events WHERE seq = {seq}")
    one, several = _both(busy_ledger)
    assert one == several
    assert any(f"expected seq {seq}, the chain has a gap" in problem for problem in one[0]), one[0]


def test_several_processes_read_one_snapshot_while_appends_go_on(busy_ledger):
    """Every process imports the verifying transaction's snapshot: appends
    committed meanwhile are seen by none of them, so the head and the balances agree."""
    ledger = Ledger(busy_ledger)
    account = customer_with(ledger, 1)
    ledger.close()
    stop = threading.Event()

    with ThreadPoolExecutor(max_workers=1) as pool:
        writer = pool.submit(keep_granting, busy_ledger, account, stop)
        try:
            reports = []
            for _ in range(2):
                with snapshot_connection(busy_ledger) as conn:
                    reports.append(verify(conn, processes=PROCESSES))
        finally:
            stop.set()
        assert writer.result() > 0, "appends went on while verifying"
    assert [r.problems for r in reports] == [[], []]
