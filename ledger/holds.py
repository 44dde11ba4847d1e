"""Two-phase holds: reservations beside the log, committed without waiting for a flush.

A hold is placed (amount, expiry), then closed exactly once: settled by the
durable `RequestSettled` append (which captures part or all and releases the
rest), released without a charge, or expired by the sweeper.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

import orjson
from sqlalchemy import Connection, delete, select, update

from ledger import accounts as acc
from ledger import bulk
from ledger import commands as cmd
from ledger import events as ev
from ledger import spend_limits
from ledger.db import is_postgres, skip_flush_wait
from ledger.errors import (
    IdempotencyConflict,
    InsufficientFunds,
    InvalidInput,
    LedgerError,
    SpendLimitReached,
    UnknownAccount,
    WrongAccountKind,
)
from ledger.money import require_positive
from ledger.schema import holds, utc_now
from ledger.store import CREATED, EXISTS

log = logging.getLogger(__name__)

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
    # When set, the hold also reserves against this spend limit (an API key's).
    spend_limit_id: int | None = None


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
    if request.spend_limit_id is not None and (type(request.spend_limit_id) is not int or request.spend_limit_id <= 0):
        raise InvalidInput("a spend limit id is a positive integer")
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
    limit_ids = sorted({requests[i].spend_limit_id for i in to_place} - {None})
    acc.lock_customer_holds(conn, account_ids)
    spend_limits.lock_limits(conn, limit_ids)
    books = acc.read_books(conn, account_ids)
    available = {a: view.available_nano_usd for a, view in books.items()}
    limit_available = {i: view["available_nano_usd"] for i, view in spend_limits.read_limits(conn, limit_ids).items()}
    placed: dict[int, int] = {}
    limit_placed: dict[int, int] = {}
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
        lowest = request.minimum_nano_usd or request.amount_nano_usd
        limit_id = request.spend_limit_id
        if limit_id is not None and limit_available.get(limit_id, 0) < lowest:
            results[i] = _limit_refusal(request, limit_available.get(limit_id))
            continue
        amount = min(request.amount_nano_usd, available[request.account_id],
                     request.amount_nano_usd if limit_id is None else limit_available[limit_id])
        if amount < lowest:
            results[i] = _refusal(request, "overdraft", available[request.account_id])
            continue
        available[request.account_id] -= amount
        placed[request.account_id] = placed.get(request.account_id, 0) + amount
        if limit_id is not None:
            limit_available[limit_id] -= amount
            limit_placed[limit_id] = limit_placed.get(limit_id, 0) + amount
        seen_keys[request.idempotency_key] = i
        granted[i] = amount
        rows.append((request.account_id, amount, request.idempotency_key, request.ttl_s, limit_id))
    ids = bulk.insert_holds(conn, rows, now)
    bulk.add_holds_placed(conn, placed)
    bulk.add_limit_placed(conn, limit_placed)
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
    "%(account)s::bigint[], %(amount)s::bigint[], %(minimum)s::bigint[], %(key)s::text[], %(ttl_s)s::int[], "
    "%(spend_limit)s::bigint[], %(now)s)"
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
            elif (placed.status == EXISTS and _matches_stored(_Stored(requests[first].account_id, placed.amount_nano_usd,
                                                                      requests[first].spend_limit_id), requests[i])) \
                    or (placed.status == CREATED and _same_hold(requests[first], requests[i])):
                results[i] = placed._replace(status=EXISTS)
            else:
                results[i] = _key_conflict(requests[i])
    return results  # type: ignore[return-value]


class _Stored(NamedTuple):
    account_id: int
    amount_nano_usd: int
    spend_limit_id: int | None


def _call_place_holds(conn: Connection, requests: list[PlaceHold]) -> list[HoldResult | LedgerError]:
    params = {
        "account": bulk.ints([r.account_id for r in requests]),
        "amount": bulk.ints([r.amount_nano_usd for r in requests]),
        "minimum": bulk.nullable_ints([r.minimum_nano_usd for r in requests]),
        "key": bulk.texts([r.idempotency_key for r in requests]),
        "ttl_s": bulk.ints([r.ttl_s for r in requests]),
        "spend_limit": bulk.nullable_ints([r.spend_limit_id for r in requests]),
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
    if error_code == "spend_limit_reached":
        return _limit_refusal(request, available)
    if error_code == "unknown_account":
        return UnknownAccount(f"account {request.account_id} does not exist")
    if error_code == "wrong_account_kind":
        return WrongAccountKind(f"holds are placed on customer accounts; {request.account_id} is not one")
    return _key_conflict(request)


def _limit_refusal(request: PlaceHold, available: int | None) -> SpendLimitReached:
    return SpendLimitReached(f"spend limit {request.spend_limit_id} has {available or 0} nano-USD left, "
                             f"hold needs {request.minimum_nano_usd or request.amount_nano_usd}")


def _same_hold(a: PlaceHold, b: PlaceHold) -> bool:
    """What a hold's idempotency key is compared on (the expiry may differ on a retry)."""
    return (a.account_id, a.amount_nano_usd, a.minimum_nano_usd, a.spend_limit_id) == \
        (b.account_id, b.amount_nano_usd, b.minimum_nano_usd, b.spend_limit_id)


def _matches_stored(row, request: PlaceHold) -> bool:
    """A stored hold answers a retry when it is one the request could have placed."""
    floor = request.minimum_nano_usd or request.amount_nano_usd
    return (row.account_id == request.account_id and row.spend_limit_id == request.spend_limit_id
            and floor <= row.amount_nano_usd <= request.amount_nano_usd)


def _key_conflict(request: PlaceHold) -> IdempotencyConflict:
    return IdempotencyConflict(f"hold key {request.idempotency_key!r} was used with other content")


def settlement_key(request_id: str) -> str:
    """The idempotency key of a request's settlement, whoever appends it (the
    proxy when the request ends, the sweeper after a crash): at most one."""
    return f"settle:{request_id}"


class HoldRenewal(NamedTuple):
    """A hold still in use, and what its request has delivered so far."""

    hold_id: int
    ttl_s: int
    capture_nano_usd: int = 0  # 0 until something was delivered
    owner_account_id: int | None = None  # who produced it (paid when the hold settles at its capture)
    request_id: str | None = None
    meta: dict | None = None  # the settlement's metadata


def validate_renewal(renewal: HoldRenewal) -> None:
    if type(renewal.ttl_s) is not int or not (0 < renewal.ttl_s <= HOLD_TTL_S_MAX):
        raise InvalidInput(f"hold ttl must be 1 to {HOLD_TTL_S_MAX} s")
    if type(renewal.capture_nano_usd) is not int or renewal.capture_nano_usd < 0:
        raise InvalidInput("a recorded capture is a non-negative integer of nano-USD")
    if renewal.capture_nano_usd:
        cmd.validate_shape(_capture_settlement(renewal.hold_id, renewal.owner_account_id, renewal.capture_nano_usd,
                                               renewal.request_id, renewal.meta or {}))


def _valid_or_plain(renewal: HoldRenewal) -> HoldRenewal:
    """A renewal whose usage record is invalid still renews its hold: one bad
    record must not let a running request, or a whole batch, lose its hold."""
    try:
        validate_renewal(renewal)
        return renewal
    except InvalidInput:
        if renewal.capture_nano_usd == 0:
            raise
        log.exception("hold %s: its usage record is invalid and is not written", renewal.hold_id)
        return HoldRenewal(renewal.hold_id, renewal.ttl_s)


def _capture_settlement(hold_id: int, owner_account_id, capture_nano_usd: int, request_id, meta: dict) -> cmd.SettleRequest:
    return cmd.SettleRequest(hold_id, owner_account_id, capture_nano_usd, request_id, settlement_key(request_id), meta)


_PG_RENEW = """
UPDATE holds AS h
SET expires_at = %(now)s + make_interval(secs => u.ttl_s),
    capture_nano_usd = least(h.amount_nano_usd, greatest(h.capture_nano_usd, u.capture)),
    capture_owner_account_id = coalesce(u.owner, h.capture_owner_account_id),
    capture_request_id = coalesce(u.request_id, h.capture_request_id),
    capture_meta = coalesce(u.meta, h.capture_meta)
FROM unnest(%(id)s::bigint[], %(ttl_s)s::int[], %(capture)s::bigint[], %(owner)s::bigint[], %(request_id)s::text[],
            %(meta)s::text[]) AS u(id, ttl_s, capture, owner, request_id, meta)
WHERE h.id = u.id
RETURNING h.id
"""


def renew_holds(conn: Connection, renewals: list[HoldRenewal], now: datetime | None = None) -> set[int]:
    """Push back the expiry of holds still in use and record what each has
    delivered (never lowered, never above the hold), in one statement for all
    of a process's requests. Returns the ids still active: a missing one was
    closed meanwhile (settled, or taken by the sweeper)."""
    if not renewals:
        return set()
    renewals = [_valid_or_plain(r) for r in renewals]
    skip_flush_wait(conn)
    now = now or utc_now()
    metas = [ev.canonical_json(r.meta) if r.capture_nano_usd else None for r in renewals]
    if is_postgres(conn):
        return {row[0] for row in bulk.pg_rows(conn, _PG_RENEW, {
            "now": now, "id": bulk.ints([r.hold_id for r in renewals]), "ttl_s": bulk.ints([r.ttl_s for r in renewals]),
            "capture": bulk.ints([r.capture_nano_usd for r in renewals]),
            "owner": bulk.nullable_ints([r.owner_account_id if r.capture_nano_usd else None for r in renewals]),
            "request_id": bulk.nullable_texts([r.request_id if r.capture_nano_usd else None for r in renewals]),
            "meta": bulk.nullable_texts(metas),
        })}
    renewed = set()
    for renewal, meta in zip(renewals, metas):
        row = conn.execute(select(holds.c.amount_nano_usd, holds.c.capture_nano_usd).where(holds.c.id == renewal.hold_id)).first()
        if row is None:
            continue
        values: dict = {"expires_at": now + timedelta(seconds=renewal.ttl_s)}
        if renewal.capture_nano_usd:
            values.update(capture_nano_usd=min(row.amount_nano_usd, max(row.capture_nano_usd, renewal.capture_nano_usd)),
                          capture_owner_account_id=renewal.owner_account_id, capture_request_id=renewal.request_id,
                          capture_meta=meta)
        conn.execute(update(holds).where(holds.c.id == renewal.hold_id).values(**values))
        renewed.add(renewal.hold_id)
    return renewed


def release_hold(conn: Connection, hold_id: int) -> bool:
    """Release a hold without charging; False when it was already closed."""
    skip_flush_wait(conn)
    closed = conn.execute(
        delete(holds).where(holds.c.id == hold_id).returning(holds.c.account_id, holds.c.amount_nano_usd, holds.c.spend_limit_id)
    ).first()
    if closed is None:
        return False
    _count_closed(conn, [closed])
    return True


def _count_closed(conn: Connection, closed_rows) -> None:
    """(account, amount, spend limit) of holds closed without a settlement."""
    by_account: dict[int, int] = {}
    by_limit: dict[int, int] = {}
    for account_id, amount, limit_id in closed_rows:
        by_account[account_id] = by_account.get(account_id, 0) + amount
        if limit_id is not None:
            by_limit[limit_id] = by_limit.get(limit_id, 0) + amount
    bulk.add_holds_closed(conn, by_account)
    bulk.add_limit_closed(conn, by_limit)


def expire_holds(conn: Connection, now: datetime | None = None, limit: int = EXPIRE_BATCH_SIZE_MAX) -> int:
    """Void holds past their expiry that delivered nothing (a proxy crashed
    before the first token, or forgot); returns how many. Holds that recorded
    delivered usage are left to `expired_captures`: they settle, not release."""
    skip_flush_wait(conn)
    now = now or utc_now()
    due = (
        select(holds.c.id)
        .where(holds.c.expires_at < now, holds.c.capture_nano_usd == 0)
        .order_by(holds.c.expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    ids = [r[0] for r in conn.execute(due)]
    if not ids:
        return 0
    expired = conn.execute(
        delete(holds).where(bulk.one_of(conn, holds.c.id, ids))
        .returning(holds.c.account_id, holds.c.amount_nano_usd, holds.c.spend_limit_id)
    ).all()
    _count_closed(conn, expired)
    return len(expired)


def expired_captures(conn: Connection, now: datetime | None = None, limit: int = EXPIRE_BATCH_SIZE_MAX) -> list[cmd.SettleRequest]:
    """The settlements due for holds past their expiry that recorded delivered
    usage: each charges what its request had delivered when last recorded and
    closes the hold (or finds it settled already: the key is the request's).
    The rows stay locked until the caller's transaction ends, so append the
    settlements in it: a renewal or the request's own settlement racing the
    sweeper then waits, and finds the hold settled."""
    rows = conn.execute(
        select(holds.c.id, holds.c.capture_nano_usd, holds.c.capture_owner_account_id, holds.c.capture_request_id,
               holds.c.capture_meta)
        .where(holds.c.expires_at < (now or utc_now()), holds.c.capture_nano_usd > 0)
        .order_by(holds.c.expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    return [_capture_settlement(r.id, r.capture_owner_account_id, r.capture_nano_usd, r.capture_request_id,
                                orjson.loads(r.capture_meta)) for r in rows]
