"""Two-phase holds: reservations beside the log, committed without waiting for a flush.

A hold is placed (amount, expiry), then closed exactly once: settled by the
durable `RequestSettled` append (which captures part or all and releases the
rest), released without a charge, or expired by the sweeper.
"""
from __future__ import annotations

import logging
from datetime import datetime, timedelta

import orjson
from sqlalchemy import Connection, delete, select

from ledger import accounts as acc
from ledger import commands as cmd
from ledger import events as ev
from ledger import spend_limits
from ledger.db import storage_of
from ledger.errors import HoldNotActive, InsufficientFunds, InvalidInput, LedgerError, UnknownAccount, WrongAccountKind, a_or_an
from ledger.hold_commands import (  # noqa: F401 (HoldRenewal, settlement_key and the validators: this module's API)
    CREATED,
    EXISTS,
    HoldRenewal,
    HoldResult,
    PlaceHold,
    capture_settlement,
    key_conflict,
    limit_refusal,
    matches_stored,
    refusal,
    same_hold,
    settlement_key,
    validate_place_hold,
    validate_renewal,
)
from ledger.limits import HOLD_TTL_S_DEFAULT, HOLD_TTL_S_MAX, HOLDS_EXPIRED_PER_SWEEP_MAX  # noqa: F401
from ledger.schema import holds, utc_now
from ledger.storage.base import in_chunks

log = logging.getLogger(__name__)


def place_holds(conn: Connection, requests: list[PlaceHold]) -> list[HoldResult | LedgerError]:
    """Place holds in the caller's transaction, each checked against credits
    minus active holds (and against its spend limit, if it names one).

    The storage runs the rules: in this process (`_place_holds_here`), or on a
    database that runs them itself, as one statement on the path to every first token."""
    return storage_of(conn).place_holds(conn, requests, _place_holds_here)


def _place_holds_here(conn: Connection, requests: list[PlaceHold]) -> list[HoldResult | LedgerError]:
    """The placement rules, statement by statement (PostgreSQL's server function mirrors them)."""
    storage = storage_of(conn)
    storage.skip_flush_wait(conn)
    results: list[HoldResult | LedgerError | None] = [None] * len(requests)
    to_place = _answer_stored_keys(conn, requests, results)
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
            if same_hold(requests[first_index], request):
                repeats[i] = first_index
            else:
                results[i] = key_conflict(request)
            continue
        view = books.get(request.account_id)
        if view is None:
            results[i] = UnknownAccount(f"account {request.account_id} does not exist")
            continue
        if view.kind != cmd.CUSTOMER:
            results[i] = WrongAccountKind(f"holds are placed on customer accounts; {request.account_id} is {a_or_an(view.kind)} account")
            continue
        lowest = request.minimum_nano_usd or request.amount_nano_usd
        limit_id = request.spend_limit_id
        if limit_id is not None and limit_available.get(limit_id, 0) < lowest:
            results[i] = limit_refusal(request, limit_available.get(limit_id))
            continue
        amount = min(request.amount_nano_usd, available[request.account_id],
                     request.amount_nano_usd if limit_id is None else limit_available[limit_id])
        if amount < lowest:
            results[i] = refusal(request, InsufficientFunds.code, available[request.account_id])
            continue
        available[request.account_id] -= amount
        placed[request.account_id] = placed.get(request.account_id, 0) + amount
        if limit_id is not None:
            limit_available[limit_id] -= amount
            limit_placed[limit_id] = limit_placed.get(limit_id, 0) + amount
        seen_keys[request.idempotency_key] = i
        granted[i] = amount
        rows.append((request.account_id, amount, request.idempotency_key, request.ttl_s, limit_id, request.replica_id))
    ids = storage.insert_holds(conn, rows, now)
    storage.add_holds_placed(conn, placed)
    storage.add_limit_placed(conn, limit_placed)
    for i in to_place:
        if results[i] is None and i not in repeats:
            r = requests[i]
            results[i] = HoldResult(CREATED, ids[r.idempotency_key], granted[i], now + timedelta(seconds=r.ttl_s))
    for i, first_index in repeats.items():  # a key repeated inside the batch answers like the first
        first = results[first_index]
        results[i] = HoldResult(EXISTS, first.hold_id, first.amount_nano_usd, first.expires_at)
    return results  # type: ignore[return-value]


def _answer_stored_keys(conn: Connection, requests: list[PlaceHold], results: list) -> list[int]:
    """Answer the requests whose key is stored already (`exists` or a conflict);
    returns the indexes of the others."""
    storage = storage_of(conn)
    existing = {}
    for chunk in in_chunks(sorted({r.idempotency_key for r in requests})):
        for row in conn.execute(select(holds).where(storage.one_of(holds.c.idempotency_key, chunk))):
            existing[row.idempotency_key] = row
    to_place = []
    for i, request in enumerate(requests):
        row = existing.get(request.idempotency_key)
        if row is None:
            to_place.append(i)
        elif matches_stored(row, request):
            results[i] = HoldResult(EXISTS, row.id, row.amount_nano_usd, row.expires_at)
        else:
            results[i] = key_conflict(request)
    return to_place


def split_holds(conn: Connection, splits: list[tuple[int, PlaceHold]]) -> list[HoldResult | LedgerError]:
    """Move each request's amount out of its pooled hold (ledger.hold_pool)
    into a hold of its own, keyed by the request, in a few statements for all
    of them: a request that runs long enough to record what it has delivered
    (renewals) records it there, and settles or is released alone. The
    customer's and the spend limit's held sums do not change.

    A key moved before answers `exists` (or a conflict). The requests of a
    pooled hold that is gone, has less left than they ask, or belongs to
    another customer or limit are refused with HoldNotActive, and nothing
    moves for them. One result per split, in order."""
    for _, request in splits:
        validate_place_hold(request)
    storage = storage_of(conn)
    storage.skip_flush_wait(conn)
    results: list[HoldResult | LedgerError | None] = [None] * len(splits)
    wanted: dict[int, list[int]] = {}  # pooled hold: the indexes of its requests still to move
    for i in _answer_stored_keys(conn, [request for _, request in splits], results):
        wanted.setdefault(splits[i][0], []).append(i)
    pools = {}
    for chunk in in_chunks(sorted(wanted)):
        pools.update({row.id: row for row in conn.execute(
            select(holds.c.id, holds.c.account_id, holds.c.spend_limit_id, holds.c.amount_nano_usd)
            .where(storage.one_of(holds.c.id, chunk)).with_for_update())})
    takes, moving = {}, []
    for pooled_hold_id, indexes in wanted.items():
        pool, asked = pools.get(pooled_hold_id), [splits[i][1] for i in indexes]
        total = sum(r.amount_nano_usd for r in asked)
        if pool is None or pool.amount_nano_usd < total or any(
                (r.account_id, r.spend_limit_id) != (pool.account_id, pool.spend_limit_id) for r in asked):
            for i in indexes:
                results[i] = HoldNotActive(f"hold {pooled_hold_id} has not {total} nano-USD left for the requests of "
                                           f"account {splits[i][1].account_id} and spend limit {splits[i][1].spend_limit_id}")
            continue
        takes[pooled_hold_id] = total
        moving.extend(indexes)
    storage.take_from_holds(conn, takes)
    now = utc_now()
    ids = storage.insert_holds(conn, [(r.account_id, r.amount_nano_usd, r.idempotency_key, r.ttl_s, r.spend_limit_id, r.replica_id)
                                      for r in (splits[i][1] for i in moving)], now)
    for i in moving:
        request = splits[i][1]
        results[i] = HoldResult(CREATED, ids[request.idempotency_key], request.amount_nano_usd, now + timedelta(seconds=request.ttl_s))
    return results  # type: ignore[return-value]


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


def renew_holds(conn: Connection, renewals: list[HoldRenewal], now: datetime | None = None) -> set[int]:
    """Push back the expiry of holds still in use and record what each has
    delivered (never lowered, never above the hold), in one statement for all
    of a process's requests. Returns the ids still active: a missing one was
    closed meanwhile (settled, or taken by the sweeper)."""
    if not renewals:
        return set()
    renewals = [_valid_or_plain(r) for r in renewals]
    storage = storage_of(conn)
    storage.skip_flush_wait(conn)
    metas = [ev.canonical_json(r.meta) if r.capture_nano_usd else None for r in renewals]
    return storage.renew_holds(conn, renewals, metas, now or utc_now())


def release_hold(conn: Connection, hold_id: int) -> bool:
    """Release a hold without charging; False when it was already closed."""
    storage_of(conn).skip_flush_wait(conn)
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
    storage = storage_of(conn)
    storage.add_holds_closed(conn, by_account)
    storage.add_limit_closed(conn, by_limit)


def expire_holds(conn: Connection, now: datetime | None = None, limit: int = HOLDS_EXPIRED_PER_SWEEP_MAX) -> int:
    """Void holds past their expiry that delivered nothing (a proxy crashed
    before the first token, or forgot); returns how many. Holds that recorded
    delivered usage are left to `expired_captures`: they settle, not release."""
    return _release_untouched(conn, holds.c.expires_at < (now or utc_now()), limit)


def expired_captures(conn: Connection, now: datetime | None = None, limit: int = HOLDS_EXPIRED_PER_SWEEP_MAX) -> list[cmd.SettleRequest]:
    """The settlements due for holds past their expiry that recorded delivered
    usage: each charges what its request had delivered when last recorded and
    closes the hold (or finds it settled already: the key is the request's).
    The rows stay locked until the caller's transaction ends, so append the
    settlements in it: a renewal or the request's own settlement racing the
    sweeper then waits, and finds the hold settled."""
    return _captures(conn, holds.c.expires_at < (now or utc_now()), limit)


def holds_of_replica(conn: Connection, replica_id: str) -> dict[int, datetime]:
    """The open holds a replica placed, with their expiries: read by a replica
    as it starts, before it places any, they are what its crashed run left."""
    return dict(conn.execute(select(holds.c.id, holds.c.expires_at).where(holds.c.replica_id == replica_id)).all())


def release_orphans(conn: Connection, seen: dict[int, datetime]) -> int:
    """Release those of `seen` (hold id -> expiry, from `holds_of_replica`)
    that delivered nothing and were not renewed since: nothing runs them."""
    return _release_untouched(conn, storage_of(conn).one_of(holds.c.id, sorted(seen)), len(seen), seen)


def orphan_captures(conn: Connection, seen: dict[int, datetime]) -> list[cmd.SettleRequest]:
    """The settlements due for those of `seen` that recorded delivered usage
    and were not renewed since; locked like `expired_captures`."""
    return _captures(conn, storage_of(conn).one_of(holds.c.id, sorted(seen)), len(seen), seen)


def _unrenewed(rows, seen: dict[int, datetime] | None) -> list:
    """The locked rows whose expiry is still the one seen: a hold renewed
    meanwhile is in use by a running process (one that shares the replica id)."""
    return rows if seen is None else [r for r in rows if seen.get(r.id) == r.expires_at]


def _release_untouched(conn: Connection, due_where, limit: int, seen: dict[int, datetime] | None = None) -> int:
    storage = storage_of(conn)
    storage.skip_flush_wait(conn)
    due = (
        select(holds.c.id, holds.c.expires_at)
        .where(due_where, holds.c.capture_nano_usd == 0)
        .order_by(holds.c.expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    ids = [r.id for r in _unrenewed(conn.execute(due).all(), seen)]
    if not ids:
        return 0
    expired = conn.execute(
        delete(holds).where(storage.one_of(holds.c.id, ids))
        .returning(holds.c.account_id, holds.c.amount_nano_usd, holds.c.spend_limit_id)
    ).all()
    _count_closed(conn, expired)
    return len(expired)


def _captures(conn: Connection, due_where, limit: int, seen: dict[int, datetime] | None = None) -> list[cmd.SettleRequest]:
    rows = conn.execute(
        select(holds.c.id, holds.c.expires_at, holds.c.capture_nano_usd, holds.c.capture_owner_account_id,
               holds.c.capture_request_id, holds.c.capture_meta)
        .where(due_where, holds.c.capture_nano_usd > 0)
        .order_by(holds.c.expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    return [capture_settlement(r.id, r.capture_owner_account_id, r.capture_nano_usd, r.capture_request_id,
                               orjson.loads(r.capture_meta)) for r in _unrenewed(rows, seen)]
