"""What `ledger verify` proves of payouts, beside the chain and the balances:
each rail's in-flight account holds exactly the payouts in flight on it, and
every payout's row agrees with the ledger events it names (who, how much,
which step). The rails' own references are checked against the chain and
Stripe by their modules when those are configured."""
from __future__ import annotations

from collections import defaultdict

import orjson
from sqlalchemy import Connection, select

from app.payments.payouts import FAILED, IN_FLIGHT, SETTLED
from app.payments.schema import payouts
from ledger import commands as cmd
from ledger.schema import account_balances, accounts, ledger_events
from ledger.storage.base import in_chunks

CLOSING_EVENT = {SETTLED: "PayoutSettled", FAILED: "PayoutFailed"}


def payout_problems(conn: Connection) -> list[str]:
    """Every disagreement between the payouts table and the ledger, in words."""
    rows = conn.execute(select(payouts)).all()
    problems = _in_flight_problems(conn, rows)
    events = _events(conn, [seq for row in rows for seq in (row.requested_seq, row.closed_seq) if seq is not None])
    for row in rows:
        problems += _row_problems(row, events)
    return problems


def _in_flight_problems(conn: Connection, rows) -> list[str]:
    held: dict[str, int] = defaultdict(int)
    for row in rows:
        if row.state in IN_FLIGHT:
            held[row.rail] += row.amount_nano_usd
    problems = []
    for rail in cmd.PAYOUT_RAILS:
        balance = conn.execute(select(account_balances.c.balance_nano_usd).join(accounts, accounts.c.id == account_balances.c.account_id)
                               .where(accounts.c.system_code == cmd.payouts_in_flight_account(rail))).scalar_one()
        if balance != held[rail]:
            problems.append(f"payouts in flight on {rail}: the ledger holds {balance} nano-USD, the payouts in flight {held[rail]}")
    return problems


def _events(conn: Connection, seqs: list[int]) -> dict[int, tuple[str, dict]]:
    found = {}
    for chunk in in_chunks(seqs):
        for seq, event_type, payload in conn.execute(select(ledger_events.c.seq, ledger_events.c.event_type, ledger_events.c.payload)
                                                     .where(ledger_events.c.seq.in_(chunk))):
            found[seq] = (event_type, orjson.loads(payload))
    return found


def _row_problems(row, events: dict[int, tuple[str, dict]]) -> list[str]:
    steps = [("PayoutRequested", row.requested_seq)]
    if row.state in CLOSING_EVENT:
        steps.append((CLOSING_EVENT[row.state], row.closed_seq))
    problems = []
    for event_type, seq in steps:
        found_type, payload = events.get(seq, (None, {}))
        if found_type != event_type:
            problems.append(f"payout {row.id} ({row.state}) names event {seq} as its {event_type}, which is {found_type or 'missing'}")
            continue
        said = (payload["payout_id"], payload["owner_account_id"], payload["rail"], payload["amount_nano_usd"])
        if said != (row.id, row.owner_account_id, row.rail, row.amount_nano_usd):
            problems.append(f"payout {row.id}: event {seq} says payout {said[0]} of account {said[1]}, {said[3]} nano-USD on {said[2]}")
    return problems
