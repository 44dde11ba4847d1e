"""Hold requests and the pure rules that answer them, whichever storage places them.

Like `commands`, nothing here reads a database: placement itself runs where
the storage runs it (`ledger.holds` in this process on SQLite, one server
function on PostgreSQL), and both answer with the results built here.
"""
from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import Callable, NamedTuple

from ledger import commands as cmd
from ledger.commands import CREATED, EXISTS
from ledger.errors import (
    IdempotencyConflict,
    InsufficientFunds,
    InvalidInput,
    LedgerError,
    SpendLimitReached,
    UnknownAccount,
    WrongAccountKind,
)
from ledger.limits import HOLD_TTL_S_DEFAULT, HOLD_TTL_S_MAX, IDEMPOTENCY_KEY_CHARS_MAX, REPLICA_ID_CHARS_MAX
from ledger.money import require_positive


class PlaceHold(NamedTuple):
    """A tuple, as the events are (ledger.events): one is built per request."""

    account_id: int
    amount_nano_usd: int
    idempotency_key: str
    ttl_s: int = HOLD_TTL_S_DEFAULT
    # When set, hold what is available if that is less than the amount but at
    # least this much (the proxy clamps max_tokens to it rather than refuse).
    minimum_nano_usd: int | None = None
    # When set, the hold also reserves against this spend limit (an API key's).
    spend_limit_id: int | None = None
    # The proxy replica placing it: the one that settles it at once if it
    # restarts after a crash. Not part of the key's content (a retry may come
    # through another replica).
    replica_id: str | None = None


class HoldResult(NamedTuple):
    status: str  # "created" or "exists"
    hold_id: int
    amount_nano_usd: int
    expires_at: datetime


# A HoldResult from a 4-tuple without the Python frame of its generated
# __new__ (as ledger.events.posting_of): one per request.
hold_result_of = partial(tuple.__new__, HoldResult)


class HoldRenewal(NamedTuple):
    """A hold still in use, and what its request has delivered so far."""

    hold_id: int
    ttl_s: int
    capture_nano_usd: int = 0  # 0 until something was delivered
    owner_account_id: int | None = None  # who produced it (paid when the hold settles at its capture)
    request_id: str | None = None
    meta: dict | None = None  # the settlement's metadata


def _require_ttl(ttl_s: object) -> None:
    if type(ttl_s) is not int or not (0 < ttl_s <= HOLD_TTL_S_MAX):
        raise InvalidInput(f"hold ttl must be 1 to {HOLD_TTL_S_MAX} s")


def validate_place_hold(request: PlaceHold) -> None:
    require_positive(request.amount_nano_usd, "hold amount")
    if request.minimum_nano_usd is not None:
        require_positive(request.minimum_nano_usd, "hold minimum")
        if request.minimum_nano_usd > request.amount_nano_usd:
            raise InvalidInput("hold minimum must not exceed the hold amount")
    _require_ttl(request.ttl_s)
    if request.spend_limit_id is not None and (type(request.spend_limit_id) is not int or request.spend_limit_id <= 0):
        raise InvalidInput("a spend limit id is a positive integer")
    cmd.require_text(request.idempotency_key, "idempotency key", IDEMPOTENCY_KEY_CHARS_MAX)
    if request.replica_id is not None:
        cmd.require_text(request.replica_id, "replica id", REPLICA_ID_CHARS_MAX)


def validate_renewal(renewal: HoldRenewal) -> None:
    _require_ttl(renewal.ttl_s)
    if type(renewal.capture_nano_usd) is not int or renewal.capture_nano_usd < 0:
        raise InvalidInput("a recorded capture is a non-negative integer of nano-USD")
    if renewal.capture_nano_usd:
        cmd.validate_shape(capture_settlement(renewal.hold_id, renewal.owner_account_id, renewal.capture_nano_usd,
                                              renewal.request_id, renewal.meta or {}))


def settlement_key(request_id: str) -> str:
    """The idempotency key of a request's settlement, whoever appends it (the
    proxy when the request ends, the sweeper after a crash): at most one."""
    return f"settle:{request_id}"


def capture_settlement(hold_id: int, owner_account_id, capture_nano_usd: int, request_id, meta: dict) -> cmd.SettleRequest:
    return cmd.SettleRequest(hold_id, owner_account_id, capture_nano_usd, request_id, settlement_key(request_id), meta)


def refusal(request: PlaceHold, error_code: str, available: int | None) -> LedgerError:
    """The typed error for a refusal the placement reported by its code."""
    if error_code == InsufficientFunds.code:
        return InsufficientFunds(f"account {request.account_id} has {available} nano-USD available, "
                                 f"hold needs {request.minimum_nano_usd or request.amount_nano_usd}")
    if error_code == SpendLimitReached.code:
        return limit_refusal(request, available)
    if error_code == UnknownAccount.code:
        return UnknownAccount(f"account {request.account_id} does not exist")
    if error_code == WrongAccountKind.code:
        return WrongAccountKind(f"holds are placed on customer accounts; {request.account_id} is not one")
    return key_conflict(request)


def limit_refusal(request: PlaceHold, available: int | None) -> SpendLimitReached:
    return SpendLimitReached(f"spend limit {request.spend_limit_id} has {available or 0} nano-USD left, "
                             f"hold needs {request.minimum_nano_usd or request.amount_nano_usd}")


def key_conflict(request: PlaceHold) -> IdempotencyConflict:
    return IdempotencyConflict(f"hold key {request.idempotency_key!r} was used with other content")


def same_hold(a: PlaceHold, b: PlaceHold) -> bool:
    """What a hold's idempotency key is compared on (the expiry may differ on a retry)."""
    return (a.account_id, a.amount_nano_usd, a.minimum_nano_usd, a.spend_limit_id) == \
        (b.account_id, b.amount_nano_usd, b.minimum_nano_usd, b.spend_limit_id)


def matches_stored(row, request: PlaceHold) -> bool:
    """A stored hold answers a retry when it is one the request could have placed."""
    floor = request.minimum_nano_usd or request.amount_nano_usd
    return (row.account_id == request.account_id and row.spend_limit_id == request.spend_limit_id
            and floor <= row.amount_nano_usd <= request.amount_nano_usd)


class _Stored(NamedTuple):
    account_id: int
    amount_nano_usd: int
    spend_limit_id: int | None


Placement = Callable[[list[PlaceHold]], list[HoldResult | LedgerError]]


def place_each_key_once(requests: list[PlaceHold], place: Placement) -> list[HoldResult | LedgerError]:
    """Results for `requests` from `place`, which takes each key once.

    A key repeated inside the batch answers like its first occurrence when that
    was placed, and is tried in a further call when it was refused (as the
    rules in this process do)."""
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
        for i, result in zip(batch, place([requests[i] for i in batch])):
            results[i] = result
        pending = []
        for i in later:
            first = firsts[requests[i].idempotency_key]
            placed = results[first]
            if not isinstance(placed, HoldResult):
                pending.append(i)
            elif (placed.status == EXISTS and matches_stored(_Stored(requests[first].account_id, placed.amount_nano_usd,
                                                                     requests[first].spend_limit_id), requests[i])) \
                    or (placed.status == CREATED and same_hold(requests[first], requests[i])):
                results[i] = placed._replace(status=EXISTS)
            else:
                results[i] = key_conflict(requests[i])
    return results  # type: ignore[return-value]
