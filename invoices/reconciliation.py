"""An account's reconciliation over whole UTC months: the opening balance,
what moved it by kind, the closing balance, and whether they add up.

Nothing is computed a third way: the figures are the monthly statement's
sections (`statements.movements`) and the balances are the ledger export's
(`exports.totals`), both read at one read-model position (`through_seq`), so
a reconciliation, the statements and the CSV of the same period agree to the
nano-dollar. Every statement stored for a month inside the period is held to
the same figures at its month's boundaries: a read model changed after a
statement was issued shows as a problem, and `balanced` is false."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import Engine

from invoices import exports, read_models, statements
from invoices.limits import CATCH_UP_ROUNDS_MAX
from ledger.accounts import require_kind
from ledger.commands import CUSTOMER, OWNER
from ledger.errors import InvalidInput
from ledger.log import consumer_position
from ledger.schema import utc_now

# Each figure is signed as it moved the balance (usage negative), as the statement's sections are.
FIGURE_OF_SOURCE = {"CreditsPurchased": "top_ups_nano_usd", "CreditsGranted": "credits_granted_nano_usd",
                    "CreditsRefunded": "refunds_nano_usd", "CreditsFrozen": "disputes_nano_usd",
                    "BalanceAdjusted": "adjustments_nano_usd", "PayoutRequested": "payouts_nano_usd",
                    "PayoutFailed": "payouts_returned_nano_usd"}
SETTLED_FIGURE = {CUSTOMER: "usage_nano_usd", OWNER: "earnings_nano_usd"}  # a settlement is usage to one, earnings to the other


def require_begun(first: statements.Month, now: datetime | None = None) -> None:
    if first.start > (now or utc_now()):
        raise InvalidInput(f"{first.text} has not begun")


def require_after(first: statements.Month, after: statements.Month) -> None:
    """[first, after) holds at least one month."""
    if after.start <= first.start:
        raise InvalidInput(f"to ({after.text}) must be a month after from ({first.text})")


def reconcile(engine: Engine, account_id: int, first: statements.Month, after: statements.Month,
              now: datetime | None = None, rounds_max: int = CATCH_UP_ROUNDS_MAX) -> dict:
    """The months [first, after) of a customer or owner, as of the read models' position once caught up."""
    now = now or utc_now()
    require_begun(first, now)
    require_after(first, after)
    start, end = first.start, after.start
    with engine.connect() as conn:
        kind = require_kind(conn, account_id, statements.STATED_KINDS, statements.STATED_RULE)
    statements.ensure_applied(engine, min(end, now), rounds_max)
    with engine.connect() as conn:
        through_seq = consumer_position(conn, read_models.CONSUMER)
        opening_nano_usd, sections = statements.movements(conn, account_id, start, end, through_seq)
        stored = [s for s in statements.list_statements(conn, account_id) if first.text <= s["month"] < after.text]
    totals = exports.totals(engine, account_id, start, end, through_seq)
    figures, problems = _figures(kind, sections)
    if opening_nano_usd != totals.opening_balance_nano_usd:
        problems.append(f"the statement opens at {opening_nano_usd}, the export at {totals.opening_balance_nano_usd}")
    if sum(count for count, _ in sections.values()) != totals.postings:
        problems.append(f"the statement counts {sum(c for c, _ in sections.values())} postings, the export {totals.postings}")
    moved_nano_usd = sum(figures.values())
    if totals.opening_balance_nano_usd + moved_nano_usd != totals.closing_balance_nano_usd:
        problems.append(f"opening {totals.opening_balance_nano_usd} + figures {moved_nano_usd} is not "
                        f"the closing {totals.closing_balance_nano_usd}")
    problems += _stored_statements_disagree(engine, account_id, stored, through_seq)
    return {"account_id": account_id, "kind": kind, "from": first.text, "to": after.text,
            "period_start": start.isoformat(), "period_end": end.isoformat(),
            "provisional": not statements.is_closed(statements.previous_month(after.start), now),
            "opening_balance_nano_usd": totals.opening_balance_nano_usd, **figures,
            "closing_balance_nano_usd": totals.closing_balance_nano_usd, "postings": totals.postings,
            "through_seq": through_seq, "statements_checked": [s["month"] for s in stored],
            "balanced": not problems, "problems": problems}


def _figures(kind: str, sections: dict[str, tuple[int, int]]) -> tuple[dict[str, int], list[str]]:
    """The period's sections by figure; a kind of posting no figure names is a problem, never left out quietly."""
    names = {**FIGURE_OF_SOURCE, statements.SETTLED: SETTLED_FIGURE[kind]}
    figures = dict.fromkeys(names.values(), 0)
    problems = []
    for source_type, (count, amount_nano_usd) in sorted(sections.items()):
        if source_type in names:
            figures[names[source_type]] += amount_nano_usd
        else:
            problems.append(f"{count} posting(s) of {source_type} ({amount_nano_usd}) are in no figure")
    return figures, problems


def _stored_statements_disagree(engine: Engine, account_id: int, stored: list[dict], through_seq: int) -> list[str]:
    """Each stored statement's balances against the export's for its month, at the same position."""
    problems = []
    for statement in stored:
        month = statements.parse_month(statement["month"])
        found = exports.totals(engine, account_id, month.start, month.end, through_seq)
        said = (statement["opening_balance_nano_usd"], statement["closing_balance_nano_usd"])
        if said != (found.opening_balance_nano_usd, found.closing_balance_nano_usd):
            problems.append(f"the stored statement of {month.text} says {said[0]} to {said[1]}, the postings now "
                            f"{found.opening_balance_nano_usd} to {found.closing_balance_nano_usd}")
    return problems

