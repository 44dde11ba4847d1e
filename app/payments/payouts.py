"""Owners' payouts, rail by rail: where each owner is paid, and every payout's
way through the ledger (requested, sent, settled or failed back to earnings).

Each step changes the payout's row and appends its ledger event in ONE
transaction, and each row change is conditional on the state it leaves, so a
step taken twice (two senders, a retried webhook) does nothing the second
time. The owner's earnings cannot go below zero (the ledger checks it inside
the append); at most one payout per owner and rail is in flight (a unique
index on the in-flight rows). The rails themselves (app/payments/payout_chain.py,
app/payments/payout_stripe.py) only call these steps.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, Engine, or_, select, update
from sqlalchemy.exc import IntegrityError

from app import outbox
from app.limits import PAYOUT_DESTINATION_COOLDOWN_S, PAYOUT_FAILURE_CHARS_MAX, PAYOUTS_LISTED_MAX, USDC_DECIMALS
from app.payments.schema import payout_destinations, payout_transactions, payouts
from ledger import commands as cmd
from ledger.accounts import read_balance, require_kind
from ledger.errors import InvalidInput, LedgerError
from ledger.money import NANO_USD_PER_CENT, nano_usd_per_unit, nano_usd_to_usd_text
from ledger.schema import utc_now
from ledger.store import append_one as _append_one

USDC, STRIPE = "usdc", "stripe"
DESTINATION_CHANGED_TASK = "paralon.payout_destination_changed"  # mails the owner's people (app/jobs/payout_mail.py)
REQUESTED, SENT, SETTLED, FAILED = "requested", "sent", "settled", "failed"
IN_FLIGHT = (REQUESTED, SENT)
OWNERS_ONLY = "payouts are for GPU owners"
log = logging.getLogger("paralon.payouts")
_STRIPE_ACCOUNT = re.compile(r"acct_[A-Za-z0-9]{1,64}")


class PayoutInFlight(LedgerError):
    """The owner already has a payout in flight on this rail: it must settle or fail first."""

    code = "payout_in_flight"


class UnknownPayout(InvalidInput):
    code = "payout_not_found"


class NoDestination(InvalidInput):
    code = "payout_destination_missing"


class DestinationCoolingDown(LedgerError):
    """The destination changed recently: nothing is sent to it before the cooldown ends."""

    code = "payout_destination_cooling_down"


@dataclass(frozen=True)
class PayoutRules:
    """PARALON_PAYOUT_MIN_USD and the fixed fee of each rail, in nano-USD."""

    min_nano_usd: int
    fee_nano_usd: dict[str, int]
    usdc_decimals: int = USDC_DECIMALS  # of PARALON_PAYOUT_TOKEN; a payout is a whole number of its smallest unit

    def unit_nano_usd(self, rail: str) -> int:
        """The smallest amount the rail can move: a micro-USDC, a cent."""
        return nano_usd_per_unit(self.usdc_decimals) if rail == USDC else NANO_USD_PER_CENT


@dataclass(frozen=True)
class Destination:
    owner_account_id: int
    rail: str
    destination: str
    previous_destination: str | None
    changed_at: datetime
    usable_from: datetime
    weekly: bool

    def as_dict(self, now: datetime) -> dict:
        return {"rail": self.rail, "destination": self.destination, "previous_destination": self.previous_destination,
                "changed_at": self.changed_at.isoformat(), "usable_from": self.usable_from.isoformat(),
                "usable": self.usable_from <= now, "weekly": self.weekly}


def payout_token_decimals(token: str | None) -> int:
    """The decimals of PARALON_PAYOUT_TOKEN (address:decimals:symbol); USDC's when it is not set."""
    if not token:
        return USDC_DECIMALS
    from app.payments.chain_settings import parse_tokens

    parsed = parse_tokens(token)
    if len(parsed) != 1:
        raise InvalidInput("PARALON_PAYOUT_TOKEN names one token: address:decimals:symbol")
    return parsed[0].decimals


def require_rail(rail: str) -> str:
    if rail not in cmd.PAYOUT_RAILS:
        raise InvalidInput(f"rail must be one of {', '.join(cmd.PAYOUT_RAILS)}, not {rail!r}")
    return rail


def normalise_destination(rail: str, destination: str) -> str:
    """A checksummed EVM address for USDC, a connected account id (acct_…) for Stripe."""
    from eth_utils import is_address, to_checksum_address  # only here: the command line need not load it

    text = (destination or "").strip()
    if require_rail(rail) == USDC:
        if not is_address(text) or int(text, 0) == 0:  # base 0: the 0x says hex
            raise InvalidInput(f"not an EVM address: {destination!r}")
        return to_checksum_address(text)
    if not _STRIPE_ACCOUNT.fullmatch(text):
        raise InvalidInput(f"not a Stripe connected account id (acct_…): {destination!r}")
    return text


def set_destination(conn: Connection, owner_account_id: int, rail: str, destination: str,
                    now: datetime | None = None) -> tuple[Destination, bool]:
    """Where the owner is paid on `rail`; (the destination, whether it changed).
    A first destination is usable at once; a changed one after the cooldown,
    the owner's people are mailed about it (through the outbox: dispatch
    after the commit), and payouts not yet sent go back to earnings."""
    require_kind(conn, owner_account_id, (cmd.OWNER,), OWNERS_ONLY)
    destination, now = normalise_destination(rail, destination), now or utc_now()
    current = get_destination(conn, owner_account_id, rail)
    if current is not None and current.destination == destination:
        return current, False
    values = {"destination": destination, "changed_at": now}
    if current is None:
        conn.execute(payout_destinations.insert().values(owner_account_id=owner_account_id, rail=rail, usable_from=now, **values))
    else:
        usable_from = now + timedelta(seconds=PAYOUT_DESTINATION_COOLDOWN_S)
        conn.execute(update(payout_destinations)
                     .where(payout_destinations.c.owner_account_id == owner_account_id, payout_destinations.c.rail == rail)
                     .values(previous_destination=current.destination, usable_from=usable_from, **values))
        outbox.add(conn, DESTINATION_CHANGED_TASK, owner_account_id, rail)
        _fail_unsent(conn, owner_account_id, rail, now)
    return get_destination(conn, owner_account_id, rail), current is not None


def _fail_unsent(conn: Connection, owner_account_id: int, rail: str, now: datetime) -> None:
    """A payout asked for but not yet signed goes back to earnings when its
    destination changes: it would otherwise wait for an address that is no
    longer the owner's. One signed already (a stored transaction) may be on
    the chain, and its sender finishes it."""
    p, signed = payouts.c, select(payout_transactions.c.payout_id)
    unsent = conn.execute(select(p.id).where(p.owner_account_id == owner_account_id, p.rail == rail, p.state == REQUESTED,
                                             p.id.not_in(signed))).scalars().all()
    for payout_id in unsent:
        fail(conn, payout_id, "the destination changed before it was sent", now)


def save_destination(engine: Engine, owner_account_id: int, rail: str, destination: str,
                     weekly: bool | None = None) -> tuple[Destination, bool]:
    """`set_destination` and, when given, `set_weekly`, in one transaction."""
    with engine.begin() as conn:
        found, changed = set_destination(conn, owner_account_id, rail, destination)
        if weekly is not None:
            found = set_weekly(conn, owner_account_id, rail, weekly)
    return found, changed


def list_destinations(conn: Connection, owner_account_id: int) -> list[Destination]:
    d = payout_destinations.c
    return [Destination(**row._mapping) for row in
            conn.execute(select(payout_destinations).where(d.owner_account_id == owner_account_id).order_by(d.rail))]


def set_weekly(conn: Connection, owner_account_id: int, rail: str, weekly: bool) -> Destination:
    """Pay out every Monday whatever exceeds the minimum (`pay_weekly`)."""
    found = conn.execute(update(payout_destinations)
                         .where(payout_destinations.c.owner_account_id == owner_account_id, payout_destinations.c.rail == rail)
                         .values(weekly=weekly))
    if found.rowcount == 0:
        raise NoDestination(f"account {owner_account_id} has no {rail} destination to pay weekly")
    return get_destination(conn, owner_account_id, rail)


def get_destination(conn: Connection, owner_account_id: int, rail: str) -> Destination | None:
    d = payout_destinations.c
    row = conn.execute(select(payout_destinations).where(d.owner_account_id == owner_account_id, d.rail == require_rail(rail))).first()
    return Destination(**row._mapping) if row else None


def round_to_rail(rules: PayoutRules, rail: str, amount_nano_usd: int) -> int:
    """What the rail can move of an amount: whole units, the remainder stays in earnings."""
    unit = rules.unit_nano_usd(rail)
    return amount_nano_usd // unit * unit


def request_payout(engine: Engine, owner_account_id: int, rail: str, amount_nano_usd: int, rules: PayoutRules,
                   now: datetime | None = None) -> dict:
    """Sets the amount (rounded down to the rail's unit) aside from the owner's
    earnings, in one transaction with the payout's row; refused with nothing
    written when it is below the minimum, exceeds the earnings, has no usable
    destination or another payout is in flight on the rail."""
    now = now or utc_now()
    amount = round_to_rail(rules, require_rail(rail), amount_nano_usd)
    fee = rules.fee_nano_usd.get(rail, 0)
    if amount < max(rules.min_nano_usd, fee + 1):
        raise InvalidInput(f"a payout is at least ${nano_usd_to_usd_text(max(rules.min_nano_usd, fee + rules.unit_nano_usd(rail)))}"
                           f" (asked: ${nano_usd_to_usd_text(amount)} in whole units of the rail)")
    try:
        with engine.begin() as conn:
            require_kind(conn, owner_account_id, (cmd.OWNER,), OWNERS_ONLY)
            destination = _usable_destination(conn, owner_account_id, rail, now)
            payout_id = conn.execute(payouts.insert().values(
                owner_account_id=owner_account_id, rail=rail, state=REQUESTED, amount_nano_usd=amount, fee_nano_usd=fee,
                destination=destination, requested_at=now).returning(payouts.c.id)).scalar_one()
            result = append_one(conn, cmd.RequestPayout(payout_id, owner_account_id, rail, amount, fee, destination,
                                                        f"payout:{payout_id}:requested"))
            conn.execute(update(payouts).where(payouts.c.id == payout_id).values(requested_seq=result.seq))
            return payout_row(conn, payout_id)
    except IntegrityError as exc:
        if _in_flight_on(engine, owner_account_id, rail):
            raise PayoutInFlight(f"account {owner_account_id} already has a {rail} payout in flight") from None
        raise exc


def retry_failed(engine: Engine, payout_id: int, rules: PayoutRules, now: datetime | None = None) -> dict:
    """A failed payout asked for again: a new payout of the same owner, rail and
    amount, to the rail's destination as it is now (the failed one stays failed)."""
    with engine.connect() as conn:
        failed = payout_row(conn, payout_id)
    if failed["state"] != FAILED:
        raise InvalidInput(f"payout {payout_id} is {failed['state']}, not failed: its rail's sender goes on with it")
    return request_payout(engine, failed["owner_account_id"], failed["rail"], failed["amount_nano_usd"], rules, now)


def pay_weekly(engine: Engine, rules: PayoutRules, now: datetime | None = None) -> dict:
    """Monday's run of the weekly schedule: every owner who asked for it is paid
    whatever of its earnings the rail can move, when that reaches the minimum.
    Once a week per owner and rail: a payout already requested since Monday
    00:00 UTC (by the schedule or by hand), or one in flight, is left alone."""
    now = now or utc_now()
    week_start = (now - timedelta(days=now.weekday())).replace(hour=0, minute=0, second=0, microsecond=0)
    d, p = payout_destinations.c, payouts.c
    with engine.connect() as conn:
        due = conn.execute(select(d.owner_account_id, d.rail).where(d.weekly.is_(True), d.usable_from <= now)
                           .order_by(d.owner_account_id, d.rail)).all()
        asked = set(conn.execute(select(p.owner_account_id, p.rail).where(or_(p.requested_at >= week_start, p.state.in_(IN_FLIGHT)))).all())
    report = {"requested": [], "below_minimum": 0, "already_this_week": 0, "refused": 0}
    for owner_account_id, rail in due:
        if (owner_account_id, rail) in asked:
            report["already_this_week"] += 1
            continue
        with engine.connect() as conn:
            earnings = read_balance(conn, owner_account_id).balance_nano_usd
        if round_to_rail(rules, rail, earnings) < max(rules.min_nano_usd, rules.fee_nano_usd.get(rail, 0) + 1):
            report["below_minimum"] += 1
            continue
        try:
            report["requested"].append(request_payout(engine, owner_account_id, rail, earnings, rules, now)["id"])
        except LedgerError as exc:  # spent meanwhile, or asked by hand meanwhile: next week
            report["refused"] += 1
            log.info("weekly payout of account %s on %s not requested: %s", owner_account_id, rail, exc)
    return report


def destination_problem(conn: Connection, payout: dict, now: datetime, lock: bool = False) -> str | None:
    """Why a rail may not pay `payout` to its destination now (None: it may): the owner's
    destination on the rail is another, or it is in its cooldown. `lock` holds the destination's
    row until the caller commits, so a change cannot slip in between the check and the sending."""
    d = payout_destinations.c
    query = select(payout_destinations).where(d.owner_account_id == payout["owner_account_id"], d.rail == payout["rail"])
    current = conn.execute(query.with_for_update() if lock else query).first()
    if current is None:
        return f"the owner has no {payout['rail']} destination any more"
    if current.destination != payout["destination"]:
        return f"its destination {payout['destination']} is no longer the owner's (now {current.destination})"
    if current.usable_from > now:
        return f"its destination changed at {current.changed_at.isoformat()}: nothing goes to it before {current.usable_from.isoformat()} (its cooldown)"
    return None


def _usable_destination(conn: Connection, owner_account_id: int, rail: str, now: datetime) -> str:
    found = get_destination(conn, owner_account_id, rail)
    if found is None:
        raise NoDestination(f"account {owner_account_id} has no {rail} payout destination: set one first")
    if found.usable_from > now:
        raise DestinationCoolingDown(f"the {rail} destination changed at {found.changed_at.isoformat()}: "
                                     f"payouts go to it from {found.usable_from.isoformat()}")
    return found.destination


def _in_flight_on(engine: Engine, owner_account_id: int, rail: str) -> bool:
    with engine.connect() as conn:
        p = payouts.c
        return conn.execute(select(p.id).where(p.owner_account_id == owner_account_id, p.rail == rail,
                                               p.state.in_(IN_FLIGHT))).first() is not None


def _move(conn: Connection, payout_id: int, leaving: tuple[str, ...], values: dict) -> dict | None:
    """Moves the payout out of one of `leaving` states; None when it was not in one (a step taken already)."""
    moved = conn.execute(update(payouts).where(payouts.c.id == payout_id, payouts.c.state.in_(leaving)).values(**values))
    return payout_row(conn, payout_id) if moved.rowcount else None


def record_sent(conn: Connection, payout_id: int, reference: str, meta: dict | None = None,
                now: datetime | None = None) -> dict | None:
    """The rail took the payout under `reference`; a replacement is recorded again under its own."""
    row = _move(conn, payout_id, IN_FLIGHT, {"state": SENT, "reference": reference, "sent_at": now or utc_now()})
    if row is not None:
        append_one(conn, cmd.RecordPayoutSent(payout_id, row["rail"], reference, f"payout:{payout_id}:sent:{reference}", meta or {}))
    return row


def settle(conn: Connection, payout_id: int, reference: str, now: datetime | None = None) -> dict | None:
    """Final on its rail: in flight to the rail's account, the fee to the platform."""
    row = _move(conn, payout_id, (SENT,), {"state": SETTLED, "reference": reference, "closed_at": now or utc_now()})
    if row is None:
        return None
    result = append_one(conn, cmd.SettlePayout(payout_id, row["owner_account_id"], row["rail"], row["amount_nano_usd"],
                                               row["fee_nano_usd"], reference, f"payout:{payout_id}:settled"))
    return _closed(conn, payout_id, result.seq)


def fail(conn: Connection, payout_id: int, reason: str, now: datetime | None = None) -> dict | None:
    """Not paid: the whole amount back to the owner's earnings."""
    row = _move(conn, payout_id, IN_FLIGHT, {"state": FAILED, "failure_reason": reason[:PAYOUT_FAILURE_CHARS_MAX], "closed_at": now or utc_now()})
    if row is None:
        return None
    result = append_one(conn, cmd.FailPayout(payout_id, row["owner_account_id"], row["rail"], row["amount_nano_usd"],
                                             reason, f"payout:{payout_id}:failed"))
    return _closed(conn, payout_id, result.seq)


def reverse_settled(conn: Connection, payout_id: int, reason: str, now: datetime | None = None) -> dict | None:
    """A settled payout its rail took back (a reversed Stripe transfer): the
    settlement is reversed (the amount back in flight, the fee back from the
    platform), then the payout fails back to the owner's earnings, whole.
    None when it is not settled (taken back already, or never settled)."""
    row = _move(conn, payout_id, (SETTLED,), {"state": FAILED, "failure_reason": reason[:PAYOUT_FAILURE_CHARS_MAX],
                                              "closed_at": now or utc_now()})
    if row is None:
        return None
    append_one(conn, cmd.ReverseEvent(row["closed_seq"], f"payout {payout_id} taken back by its rail: {reason}",
                                      f"payout:{payout_id}:settlement_reversed"))
    result = append_one(conn, cmd.FailPayout(payout_id, row["owner_account_id"], row["rail"], row["amount_nano_usd"],
                                             reason, f"payout:{payout_id}:failed"))
    return _closed(conn, payout_id, result.seq)


def _closed(conn: Connection, payout_id: int, seq: int) -> dict:
    conn.execute(update(payouts).where(payouts.c.id == payout_id).values(closed_seq=seq))
    return payout_row(conn, payout_id)


def append_one(conn: Connection, command: cmd.Command):
    cmd.validate_shape(command)
    return _append_one(conn, command)


def payout_row(conn: Connection, payout_id: int) -> dict:
    row = conn.execute(select(payouts).where(payouts.c.id == payout_id)).first()
    if row is None:
        raise UnknownPayout(f"no payout {payout_id}")
    return dict(row._mapping)


def get_payout(conn: Connection, payout_id: int, owner_account_id: int | None = None) -> dict:
    """One payout; an owner's own only when `owner_account_id` is given (another's is unknown)."""
    row = payout_row(conn, payout_id)
    if owner_account_id is not None and row["owner_account_id"] != owner_account_id:
        raise UnknownPayout(f"no payout {payout_id}")
    return row


def list_payouts(conn: Connection, owner_account_id: int, limit: int = PAYOUTS_LISTED_MAX) -> list[dict]:
    p = payouts.c
    rows = conn.execute(select(payouts).where(p.owner_account_id == owner_account_id).order_by(p.id.desc()).limit(limit))
    return [dict(row._mapping) for row in rows]


def payout_view(row: dict) -> dict:
    """What the API and the CLI show of a payout."""
    return {
        "id": row["id"], "owner_account_id": row["owner_account_id"], "rail": row["rail"], "state": row["state"],
        "amount_nano_usd": row["amount_nano_usd"], "amount_usd": nano_usd_to_usd_text(row["amount_nano_usd"]),
        "fee_nano_usd": row["fee_nano_usd"], "net_nano_usd": row["amount_nano_usd"] - row["fee_nano_usd"],
        "destination": row["destination"], "reference": row["reference"],
        "raw_amount": None if row["raw_amount"] is None else str(int(row["raw_amount"])),
        "confirmations": row["confirmations"], "requested_at": row["requested_at"].isoformat(),
        "sent_at": row["sent_at"] and row["sent_at"].isoformat(), "closed_at": row["closed_at"] and row["closed_at"].isoformat(),
        "requested_seq": row["requested_seq"], "closed_seq": row["closed_seq"], "failure_reason": row["failure_reason"],
    }
