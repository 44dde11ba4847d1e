"""The outbox: a task written in a transaction is sent only if that
transaction commits, by the send function its caller gives, in order, at
least once: a send that fails leaves the task for the next dispatch."""
from __future__ import annotations

import grimp
import pytest
from sqlalchemy import func, select

from app import outbox


class Sent(list):
    def __call__(self, task: str, args: list) -> None:
        self.append((task, args))


def _waiting(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(outbox.outbox).where(outbox.outbox.c.dispatched_at.is_(None))).scalar_one()


def test_only_committed_tasks_are_sent_in_order_and_once(engine):
    with engine.begin() as conn:
        outbox.add(conn, "paralon.issue_invoice", 7)
        outbox.add(conn, "paralon.issue_credit_note", 9, 7)
    with pytest.raises(RuntimeError), engine.begin() as conn:
        outbox.add(conn, "paralon.issue_invoice", 8)
        raise RuntimeError("the transaction that needed the task failed")
    sent = Sent()
    assert outbox.dispatch(engine, sent) == 2
    assert sent == [("paralon.issue_invoice", [7]), ("paralon.issue_credit_note", [9, 7])]
    assert outbox.dispatch(engine, sent) == 0 and len(sent) == 2, "a sent task is not sent again"


def test_a_failed_send_leaves_the_task_for_the_next_dispatch(engine):
    with engine.begin() as conn:
        outbox.add(conn, "paralon.issue_invoice", 1)
        outbox.add(conn, "paralon.issue_invoice", 2)

    def broker_down(task: str, args: list) -> None:
        raise ConnectionError("the broker is down")

    with pytest.raises(ConnectionError):
        outbox.dispatch(engine, broker_down)
    assert _waiting(engine) == 2
    sent = Sent()
    assert outbox.dispatch(engine, sent) == 2 and [args for _, args in sent] == [[1], [2]]
    assert _waiting(engine) == 0


@pytest.mark.parametrize("payments", ["app.payments.stripe", "app.payments.crypto"])
def test_no_import_leads_from_the_payment_modules_back_to_them(payments):
    """The circle payments -> outbox -> Celery app -> settings -> payments is gone, imports
    inside functions included: the outbox takes a send function instead of importing the Celery app."""
    graph = grimp.build_graph("app", "invoices", "ledger", "proxy", cache_dir=None)
    for imported in ("app.jobs.celery", "app.settings"):
        assert graph.find_shortest_chain(importer=payments, imported=imported) is None, imported
