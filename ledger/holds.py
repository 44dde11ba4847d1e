"""Two-phase holds: reservations beside the log, committed without waiting for a flush.

A hold is placed (amount, expiry), then closed exactly once: settled by the
durable `RequestSettled` append (which captures part or all and releases the
rest), released without a charge, or expired by the sweeper.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import Connection, delete, select

from ledger import accounts as acc
from ledger import bulk
from ledger import commands as cmd
from ledger.db import is_postgres, skip_flush_wait
from ledger.errors import (
    IdempotencyConflict,
    InsufficientFunds,
    InvalidInput,
    LedgerError,
    UnknownAccount,
    WrongAccountKind,
)
from ledger.money import require_positive
from ledger.schema import holds, utc_now
from ledger.store import CREATED, EXISTS

HOLD_TTL_S_DEFAULT = 15 * 60
HOLD_TTL_S_MAX = 24 * 3600
EXPIRE_BATCH_SIZE_MAX = 1000


@dataclass(frozen=True, slots=True)
class PlaceHold:
    account_id: int
    amount_nano_usd: int
    idempotency_key: str
    ttl_s: int = HOLD_TTL_S_DEFAULT
    # When set, hold what is available if that is less than the amount but at
    # least this much (the proxy clamps max_tokens to it rather than refuse).
    minimum_nano_usd: int | None = None


class HoldResult(NamedTuple):
    status: str  # "created" or "exists"
    hold_id: int
    amount_nano_usd: int
    expires_at: datetime


def validate_place_hold(request: PlaceHold) -> None:
    require_positive(request.amount_nano_usd, "hold amount")
    if request.minimum_nano_usd is not None:
        require_positive(request.minimum_nano_usd, "hold minimum")
        if request.minimum_nano_usd > request.amount_nano_usd:
            raise InvalidInput("hold minimum must not exceed the hold amount")
    if type(request.ttl_s) is not int or not (0 < request.ttl_s <= HOLD_TTL_S_MAX):
        raise InvalidInput(f"hold ttl must be 1 to {HOLD_TTL_S_MAX} s")
    cmd.require_text(request.idempotency_key, "idempotency key", cmd.KEY_LENGTH_MAX)


def place_holds(conn: Connection, requests: list[PlaceHold]) -> list[HoldResult | LedgerError]:
    """Place holds in the caller's transaction, each checked against credits minus active holds.

    On PostgreSQL the same rules run as one function call (migration 0003):
    one round trip on the path to every first token."""
    if is_postgres(conn):
        return _place_holds_in_one_statement(conn, requests)
    skip_flush_wait(conn)
    results: list[HoldResult | LedgerError | None] = [None] * len(requests)
    existing = {}
    for chunk in bulk.in_chunks(sorted({r.idempotency_key for r in requests})):
        for row in conn.execute(select(holds).where(bulk.one_of(conn, holds.c.idempotency_key, chunk))):
            existing[row.idempotency_key] = row
    to_place = []
    for i, request in enumerate(requests):
        row = existing.get(request.idempotency_key)
        if row is None:
            to_place.append(i)
        elif _matches_stored(row, request):
            results[i] = HoldResult(EXISTS, row.id, row.amount_nano_usd, row.expires_at)
        else:
            results[i] = _key_conflict(request)

    account_ids = sorted({requests[i].account_id for i in to_place})
    acc.lock_customer_holds(conn, account_ids)
    books = acc.read_books(conn, account_ids)
    available = {a: view.available_nano_usd for a, view in books.items()}
    placed: dict[int, int] = {}
    now = utc_now()
    rows, seen_keys, repeats, granted = [], {}, {}, {}
    for i in to_place:
        request = requests[i]
        if request.idempotency_key in seen_keys:
            first_index = seen_keys[request.idempotency_key]
            if _same_hold(requests[first_index], request):
                repeats[i] = first_index
            else:
                results[i] = _key_conflict(request)
            continue
        view = books.get(request.account_id)
        if view is None:
            results[i] = UnknownAccount(f"account {request.account_id} does not exist")
            continue
        if view.kind != cmd.CUSTOMER:
            results[i] = WrongAccountKind(f"holds are placed on customer accounts; {request.account_id} is a {view.kind} account")
            continue
        amount = min(request.amount_nano_usd, available[request.account_id])
        if amount < (request.minimum_nano_usd or request.amount_nano_usd):
            results[i] = InsufficientFunds(
                f"account {request.account_id} has {available[request.account_id]} nano-USD available, hold needs {request.minimum_nano_usd or request.amount_nano_usd}"
            )
            continue
        available[request.account_id] -= amount
        placed[request.account_id] = placed.get(request.account_id, 0) + amount
        seen_keys[request.idempotency_key] = i
        granted[i] = amount
        rows.append((request.account_id, amount, request.idempotency_key, request.ttl_s))
    ids = bulk.insert_holds(conn, rows, now)
    bulk.add_holds_placed(conn, placed)
    for i in to_place:
        if results[i] is None and i not in repeats:
            r = requests[i]
            results[i] = HoldResult(CREATED, ids[r.idempotency_key], granted[i], now + timedelta(seconds=r.ttl_s))
    for i, first_index in repeats.items():  # a key repeated inside the batch answers like the first
        first = results[first_index]
        results[i] = HoldResult(EXISTS, first.hold_id, first.amount_nano_usd, first.expires_at)
    return results  # type: ignore[return-value]


_PLACE_HOLDS_SQL = (
    "SELECT idx, status, hold_id, amount_nano_usd, expires_at, error_code FROM paralon_place_holds("
    "%(account)s::bigint[], %(amount)s::bigint[], %(minimum)s::bigint[], %(key)s::text[], %(ttl_s)s::int[], %(now)s)"
)


def _place_holds_in_one_statement(conn: Connection, requests: list[PlaceHold]) -> list[HoldResult | LedgerError]:
    """The function takes each key once. A key repeated inside the batch answers
    like its first occurrence when that was placed, and is tried in a further
    call when it was refused (as the rules above do)."""
    results: list[HoldResult | LedgerError | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    while pending:
        firsts: dict[str, int] = {}
        later = []
        for i in pending:
            if requests[i].idempotency_key in firsts:
                later.append(i)
            else:
                firsts[requests[i].idempotency_key] = i
        batch = list(firsts.values())
        for i, result in zip(batch, _call_place_holds(conn, [requests[i] for i in batch])):
            results[i] = result
        pending = []
        for i in later:
            first = firsts[requests[i].idempotency_key]
            placed = results[first]
            if not isinstance(placed, HoldResult):
                pending.append(i)
            elif (placed.status == EXISTS and _matches_stored(_Stored(requests[first].account_id, placed.amount_nano_usd), requests[i])) \
                    or (placed.status == CREATED and _same_hold(requests[first], requests[i])):
                results[i] = placed._replace(status=EXISTS)
            else:
                results[i] = _key_conflict(requests[i])
    return results  # type: ignore[return-value]


class _Stored(NamedTuple):
    account_id: int
    amount_nano_usd: int


def _call_place_holds(conn: Connection, requests: list[PlaceHold]) -> list[HoldResult | LedgerError]:
    params = {
        "account": bulk.ints([r.account_id for r in requests]),
        "amount": bulk.ints([r.amount_nano_usd for r in requests]),
        "minimum": bulk.nullable_ints([r.minimum_nano_usd for r in requests]),
        "key": bulk.texts([r.idempotency_key for r in requests]),
        "ttl_s": bulk.ints([r.ttl_s for r in requests]),
        "now": utc_now(),
    }
    results: list[HoldResult | LedgerError | None] = [None] * len(requests)
    for idx, status, hold_id, amount, expires_at, error_code in bulk.pg_rows(conn, _PLACE_HOLDS_SQL, params):
        results[idx] = HoldResult(status, hold_id, amount, expires_at) if error_code is None else _refusal(requests[idx], error_code, amount)
    return results  # type: ignore[return-value]


def _refusal(request: PlaceHold, error_code: str, available: int | None) -> LedgerError:
    if error_code == "overdraft":
        return InsufficientFunds(f"account {request.account_id} has {available} nano-USD available, "
                                 f"hold needs {request.minimum_nano_usd or request.amount_nano_usd}")
    if error_code == "unknown_account":
        return UnknownAccount(f"account {request.account_id} does not exist")
    if error_code == "wrong_account_kind":
        return WrongAccountKind(f"holds are placed on customer accounts; {request.account_id} is not one")
    return _key_conflict(request)


def _same_hold(a: PlaceHold, b: PlaceHold) -> bool:
    """What a hold's idempotency key is compared on (the expiry may differ on a retry)."""
    return (a.account_id, a.amount_nano_usd, a.minimum_nano_usd) == (b.account_id, b.amount_nano_usd, b.minimum_nano_usd)


def _matches_stored(row, request: PlaceHold) -> bool:
    """A stored hold answers a retry when it is one the request could have placed."""
    floor = request.minimum_nano_usd or request.amount_nano_usd
    return row.account_id == request.account_id and floor <= row.amount_nano_usd <= request.amount_nano_usd


def _key_conflict(request: PlaceHold) -> IdempotencyConflict:
    return IdempotencyConflict(f"hold key {request.idempotency_key!r} was used with other content")


def release_hold(conn: Connection, hold_id: int) -> bool:
    """Release a hold without charging; False when it was already closed."""
    skip_flush_wait(conn)
    closed = conn.execute(
        delete(holds).where(holds.c.id == hold_id).returning(holds.c.account_id, holds.c.amount_nano_usd)
    ).first()
    if closed is None:
        return False
    bulk.add_holds_closed(conn, {closed.account_id: closed.amount_nano_usd})
    return True


def expire_holds(conn: Connection, now: datetime | None = None, limit: int = EXPIRE_BATCH_SIZE_MAX) -> int:
    """Void holds past their expiry (a proxy crashed or forgot); returns how many."""
    skip_flush_wait(conn)
    now = now or utc_now()
    due = (
        select(holds.c.id)
        .where(holds.c.expires_at < now)
        .order_by(holds.c.expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    ids = [r[0] for r in conn.execute(due)]
    if not ids:
        return 0
    expired = conn.execute(
        delete(holds).where(bulk.one_of(conn, holds.c.id, ids)).returning(holds.c.account_id, holds.c.amount_nano_usd)
    ).all()
    closed: dict[int, int] = {}
    for account_id, amount in expired:
        closed[account_id] = closed.get(account_id, 0) + amount
    bulk.add_holds_closed(conn, closed)
    return len(expired)
