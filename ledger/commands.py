"""Commands and the pure rules that turn one into an event and its postings.

`prepare` and `require_covered` see the world only through `BookView`, so the
same rules run inside any group-commit batch, against the state loaded for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from typing import NamedTuple, Protocol

from ledger import events as ev
from ledger.errors import (
    CaptureExceedsHold,
    HoldNotActive,
    InsufficientFunds,
    InvalidAmount,
    InvalidInput,
    InvariantBroken,
    NotReversible,
    WrongAccountKind,
    a_or_an,
)
from ledger.limits import (
    AMOUNT_NANO_USD_MAX,
    EVIDENCE_REQUEST_IDS_MAX,
    IDEMPOTENCY_KEY_CHARS_MAX,
    INT64_MAX,
    META_ENTRIES_MAX,
    REASON_CHARS_MAX,
    SHA256_HEX_CHARS,
)
from ledger.money import require_positive, split_charge

CUSTOMER, OWNER, PLATFORM, EXTERNAL = "customer", "owner", "platform", "external"
# Kinds whose balance is money held for someone and may never go below zero.
NON_NEGATIVE_KINDS = (CUSTOMER, OWNER, PLATFORM)
PAYMENT_METHODS = ("card", "crypto")
PAYOUT_RAILS = ("usdc", "stripe")
# What an append answers: a new event, or the one a retry with the same key already made.
CREATED, EXISTS = "created", "exists"


@dataclass(frozen=True, slots=True)
class GrantCredits:
    account_id: int
    amount_nano_usd: int
    reason: str
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class PurchaseCredits:
    """Money that arrived: credited against the counter-account of where it came from."""

    account_id: int
    amount_nano_usd: int
    payment_method: str
    external_reference: str
    counter_account: str  # system code, e.g. "external:stripe"
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class RefundCredits:
    """Money that went back to the payer (a card refund): may leave a debt."""

    account_id: int
    amount_nano_usd: int
    payment_method: str
    external_reference: str
    counter_account: str
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class FreezeCredits:
    account_id: int
    amount_nano_usd: int
    external_reference: str
    frozen_account: str  # system code of where frozen amounts wait
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class ForfeitFrozenCredits:
    account_id: int
    amount_nano_usd: int
    external_reference: str
    frozen_account: str
    counter_account: str
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class AdjustBalance:
    account_id: int
    delta_nano_usd: int
    reason: str
    idempotency_key: str


# A settlement's metadata when it has none: one dict for all of them, which
# nothing writes (a settlement's event takes a copy).
_NO_META: dict = {}


class SettleRequest(NamedTuple):
    """Capture `charge_nano_usd` from a hold, split it, release the rest of the hold.

    A capture that is not final (`final_capture=False`, as Stripe's
    multicapture says it) takes only its charge and leaves the rest of the
    hold open for the next: a proxy replica's requests share one hold so
    (ledger.hold_pool), instead of placing and closing a row each.

    A tuple, as PlaceHold and the events are: one is built per request, and a
    frozen dataclass sets each field through `object.__setattr__` (1.9 µs
    against 0.7). Its metadata is read, never changed: the default is shared."""

    hold_id: int
    owner_account_id: int
    charge_nano_usd: int
    request_id: str
    idempotency_key: str
    meta: dict = _NO_META
    final_capture: bool = True


@dataclass(frozen=True, slots=True)
class RecordUsageDiscrepancy:
    request_id: str
    worker_id: int
    reported_prompt_tokens: int
    reported_completion_tokens: int
    billed_prompt_tokens: int
    billed_completion_tokens: int
    idempotency_key: str
    customer_account_id: int = 0  # 0: not known (an operator's record)
    reason: str = "usage_above_count"


@dataclass(frozen=True, slots=True)
class RecordWorkerSuspension:
    worker_id: int
    reason: str
    strikes: int
    request_ids: tuple[str, ...]  # the evidence
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class RecordWorkerResumption:
    worker_id: int
    resumed_by: str
    reason: str
    strikes_cleared: int
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class RecordInvoice:
    number: str
    kind: str
    source_seq: int
    account_id: int
    amount_nano_usd: int
    pdf_sha256: str
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class RequestPayout:
    """Earnings set aside for a payout: the owner's balance may not go below zero."""

    payout_id: int
    owner_account_id: int
    rail: str
    amount_nano_usd: int
    fee_nano_usd: int
    destination: str
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class RecordPayoutSent:
    payout_id: int
    rail: str
    reference: str
    idempotency_key: str
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SettlePayout:
    payout_id: int
    owner_account_id: int
    rail: str
    amount_nano_usd: int
    fee_nano_usd: int
    reference: str
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class FailPayout:
    payout_id: int
    owner_account_id: int
    rail: str
    amount_nano_usd: int
    reason: str
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class ReverseEvent:
    seq: int
    reason: str
    idempotency_key: str


Command = (GrantCredits | PurchaseCredits | RefundCredits | FreezeCredits | ForfeitFrozenCredits | AdjustBalance | SettleRequest
           | RecordUsageDiscrepancy | RecordWorkerSuspension | RecordWorkerResumption | RecordInvoice | ReverseEvent
           | RequestPayout | RecordPayoutSent | SettlePayout | FailPayout)


class HoldView(NamedTuple):
    hold_id: int
    account_id: int
    amount_nano_usd: int
    active: bool


hold_view_of = partial(tuple.__new__, HoldView)  # from a 4-tuple, as ev.posting_of: one per settlement, twice


class BookView(Protocol):
    """What a decision may read. Balances reflect earlier commands of the same batch."""

    def kind(self, account_id: int) -> str: ...  # raises UnknownAccount
    def balance(self, account_id: int) -> int: ...
    def held(self, account_id: int) -> int: ...  # active holds of a customer
    def hold(self, hold_id: int) -> HoldView: ...  # raises HoldNotActive
    def event_postings(self, seq: int) -> tuple[str, list[ev.Posting]]: ...  # raises UnknownEvent
    def reversal_of(self, seq: int) -> int | None: ...
    def system_account(self, code: str) -> int: ...


GRANTS_ACCOUNT = "external:grants"
ADJUSTMENTS_ACCOUNT = "external:adjustments"
PLATFORM_REVENUE_ACCOUNT = "platform:revenue"


def payouts_in_flight_account(rail: str) -> str:
    """Where a rail's requested payouts wait: the platform's, never below zero."""
    return f"platform:payouts_in_flight:{rail}"


def payouts_paid_account(rail: str) -> str:
    """The counter-account of what left through a rail."""
    return f"external:payouts:{rail}"


def command_fields(command: Command) -> dict:
    """The command's content: its fields but its idempotency key, in order."""
    kind = type(command)
    names = _CONTENT_FIELDS.get(kind)
    if names is None:
        fields = getattr(kind, "_fields", None) or kind.__slots__  # a named tuple's, or a dataclass's
        names = _CONTENT_FIELDS[kind] = tuple(k for k in fields if k != "idempotency_key")
    fields = {k: getattr(command, k) for k in names}
    if fields.get("final_capture") is True:  # the default is no content: settlements keep the digests they had before it
        del fields["final_capture"]
    return fields


_CONTENT_FIELDS: dict[type, tuple[str, ...]] = {}  # named once per command type: the digest reads them per command


def command_digest(command: Command) -> bytes:
    return ev.content_digest(type(command).__name__, command_fields(command))


def require_text(value: object, what: str, length_max: int) -> None:
    """Text every store keeps as given: no NUL (PostgreSQL refuses it), no lone surrogates."""
    if not isinstance(value, str) or len(value) > length_max or not value or value.isspace():  # isspace: no copy, as strip() makes
        raise InvalidInput(f"{what} must be 1 to {length_max} characters")
    if "\x00" in value:
        raise InvalidInput(f"{what} must not contain NUL characters")
    if value.isascii():  # a flag of the string: no surrogate, nothing to encode
        return
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InvalidInput(f"{what} is not valid Unicode text") from None


def validate_shape(command: Command) -> None:
    """Checks that need no database: run before a command is queued."""
    require_text(command.idempotency_key, "idempotency key", IDEMPOTENCY_KEY_CHARS_MAX)
    if isinstance(command, SettleRequest):  # one per request: checked before the rarer kinds are tried
        # An id that is no 64-bit integer has no canonical text: it would fail its whole batch, not itself.
        hold_id, owner = command.hold_id, command.owner_account_id
        if type(hold_id) is not int or type(owner) is not int or not (0 <= hold_id <= INT64_MAX and 0 <= owner <= INT64_MAX):
            raise InvalidInput("a settlement's hold_id and owner_account_id are non-negative 64-bit integers")
        require_positive(command.charge_nano_usd, "charge")
        require_text(command.request_id, "request id", IDEMPOTENCY_KEY_CHARS_MAX)
        _validate_meta(command.meta)
        if type(command.final_capture) is not bool:
            raise InvalidInput("a settlement's final_capture is true or false")
        return
    if hasattr(command, "reason"):
        require_text(command.reason, "a reason", REASON_CHARS_MAX)
    match command:
        case GrantCredits():
            require_positive(command.amount_nano_usd)
        case FreezeCredits() | ForfeitFrozenCredits():
            require_positive(command.amount_nano_usd)
            require_text(command.external_reference, "an external reference", REASON_CHARS_MAX)
        case PurchaseCredits() | RefundCredits():
            require_positive(command.amount_nano_usd)
            if command.payment_method not in PAYMENT_METHODS:
                raise InvalidInput(f"payment method must be one of {', '.join(PAYMENT_METHODS)}")
            require_text(command.external_reference, "an external reference", REASON_CHARS_MAX)
            require_text(command.counter_account, "a counter-account", IDEMPOTENCY_KEY_CHARS_MAX)
        case AdjustBalance():
            if type(command.delta_nano_usd) is not int or command.delta_nano_usd == 0:
                raise InvalidAmount("an adjustment must be a non-zero integer number of nano-USD")
            if abs(command.delta_nano_usd) > AMOUNT_NANO_USD_MAX:
                raise InvalidAmount("adjustment exceeds the amount limit")
        case RequestPayout() | SettlePayout() | FailPayout() | RecordPayoutSent():
            _validate_payout(command)
        case ReverseEvent():
            if type(command.seq) is not int or command.seq <= 0:
                raise InvalidInput("seq must be a positive integer")
        case RecordInvoice():
            require_text(command.number, "an invoice number", IDEMPOTENCY_KEY_CHARS_MAX)
            if command.kind not in ("invoice", "credit_note") or len(command.pdf_sha256) != SHA256_HEX_CHARS:
                raise InvalidInput("an invoice is of kind invoice or credit_note, with a hex SHA-256")
        case RecordUsageDiscrepancy():
            require_text(command.request_id, "request id", IDEMPOTENCY_KEY_CHARS_MAX)
            _require_counts(command, ("worker_id", "reported_prompt_tokens", "reported_completion_tokens",
                                      "billed_prompt_tokens", "billed_completion_tokens", "customer_account_id"))
        case RecordWorkerSuspension():
            _require_counts(command, ("worker_id", "strikes"))
            if type(command.request_ids) is not tuple or not 1 <= len(command.request_ids) <= EVIDENCE_REQUEST_IDS_MAX:
                raise InvalidInput(f"a suspension names 1 to {EVIDENCE_REQUEST_IDS_MAX} requests as its evidence")
            for request_id in command.request_ids:
                require_text(request_id, "request id", IDEMPOTENCY_KEY_CHARS_MAX)
        case RecordWorkerResumption():
            _require_counts(command, ("worker_id", "strikes_cleared"))
            require_text(command.resumed_by, "who resumed", IDEMPOTENCY_KEY_CHARS_MAX)


def _validate_payout(command: RequestPayout | SettlePayout | FailPayout | RecordPayoutSent) -> None:
    _require_counts(command, ("payout_id",))
    if command.rail not in PAYOUT_RAILS:
        raise InvalidInput(f"a payout's rail is one of {', '.join(PAYOUT_RAILS)}")
    if isinstance(command, RecordPayoutSent):
        require_text(command.reference, "a payout reference", REASON_CHARS_MAX)
        _validate_meta(command.meta)
        return
    require_positive(command.amount_nano_usd)
    if isinstance(command, FailPayout):
        return
    if type(command.fee_nano_usd) is not int or not 0 <= command.fee_nano_usd < command.amount_nano_usd:
        raise InvalidAmount("a payout's fee is a whole number of nano-USD from zero to below its amount")
    if isinstance(command, RequestPayout):
        require_text(command.destination, "a payout destination", REASON_CHARS_MAX)
    else:
        require_text(command.reference, "a payout reference", REASON_CHARS_MAX)


def _require_counts(command: Command, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(command, name)
        if type(value) is not int or not 0 <= value <= INT64_MAX:
            raise InvalidInput(f"{name} must be a non-negative integer")


def _validate_meta(meta: object) -> None:
    if type(meta) is not dict or len(meta) > META_ENTRIES_MAX:
        raise InvalidInput(f"settlement metadata is a mapping of at most {META_ENTRIES_MAX} entries")
    for name, value in meta.items():
        # A name that is an identifier (prompt_tokens) is text of the kind asked: checked without a call.
        if not (type(name) is str and name.isidentifier() and len(name) <= IDEMPOTENCY_KEY_CHARS_MAX):
            require_text(name, "a metadata name", IDEMPOTENCY_KEY_CHARS_MAX)
        if type(value) is int:
            if abs(value) > INT64_MAX:
                raise InvalidInput(f"metadata {name!r} does not fit in 64 bits")
        elif type(value) is str:
            # Plain ASCII text passes without the message naming it, which costs more than the checks.
            if value and not (len(value) <= REASON_CHARS_MAX and value.isascii() and "\x00" not in value and not value.isspace()):
                require_text(value, f"metadata {name!r}", REASON_CHARS_MAX)
        elif value is not None and type(value) is not bool:  # a flag, or a measure not known (null)
            raise InvalidInput(f"metadata {name!r} must be an integer, a string, true, false or null")


_amount_of = itemgetter(1)  # a posting's amount, without a comprehension's frame


def prepare(command: Command, book: BookView) -> tuple[object, list[ev.Posting]]:
    """The event this command produces and its postings, or a typed error: every
    rule that does not read a balance (`require_covered` is the rest)."""
    if isinstance(command, SettleRequest):  # one per request: before the rarer kinds are tried
        return prepare_settlement(command, book)
    event, postings = _prepare_other(command, book)
    if sum(map(_amount_of, postings)) != 0:
        raise InvariantBroken(f"{type(event).__name__} postings do not sum to zero")
    return event, postings


def _prepare_other(command: Command, book: BookView) -> tuple[object, list[ev.Posting]]:
    match command:
        case GrantCredits():
            _require_kind(book, command.account_id, CUSTOMER)
            counter = book.system_account(GRANTS_ACCOUNT)
            event = ev.CreditsGranted(command.account_id, command.amount_nano_usd, command.reason)
            postings = [ev.Posting(command.account_id, command.amount_nano_usd), ev.Posting(counter, -command.amount_nano_usd)]
        case PurchaseCredits():
            _require_kind(book, command.account_id, CUSTOMER)
            counter = book.system_account(command.counter_account)
            event = ev.CreditsPurchased(command.account_id, command.amount_nano_usd, command.payment_method, command.external_reference)
            postings = [ev.Posting(command.account_id, command.amount_nano_usd), ev.Posting(counter, -command.amount_nano_usd)]
        case RefundCredits():
            _require_kind(book, command.account_id, CUSTOMER)
            counter = book.system_account(command.counter_account)
            event = ev.CreditsRefunded(command.account_id, command.amount_nano_usd, command.payment_method, command.external_reference)
            postings = [ev.Posting(command.account_id, -command.amount_nano_usd), ev.Posting(counter, command.amount_nano_usd)]
        case FreezeCredits():
            _require_kind(book, command.account_id, CUSTOMER)
            frozen = book.system_account(command.frozen_account)
            event = ev.CreditsFrozen(command.account_id, command.amount_nano_usd, command.external_reference)
            postings = [ev.Posting(command.account_id, -command.amount_nano_usd), ev.Posting(frozen, command.amount_nano_usd)]
        case ForfeitFrozenCredits():
            frozen, counter = book.system_account(command.frozen_account), book.system_account(command.counter_account)
            event = ev.FrozenCreditsForfeited(command.account_id, command.amount_nano_usd, command.external_reference)
            postings = [ev.Posting(frozen, -command.amount_nano_usd), ev.Posting(counter, command.amount_nano_usd)]
        case AdjustBalance():
            kind = book.kind(command.account_id)
            if kind not in (CUSTOMER, OWNER):
                raise WrongAccountKind(f"account {command.account_id} is {a_or_an(kind)} account; only customers and owners are adjusted")
            counter = book.system_account(ADJUSTMENTS_ACCOUNT)
            event = ev.BalanceAdjusted(command.account_id, command.delta_nano_usd, command.reason)
            postings = [ev.Posting(command.account_id, command.delta_nano_usd), ev.Posting(counter, -command.delta_nano_usd)]
        case ReverseEvent():
            event, postings = _reverse(command, book)
        case RecordUsageDiscrepancy():
            event, postings = ev.UsageDiscrepancyRecorded(**command_fields(command)), []
        case RecordWorkerSuspension():
            event = ev.WorkerSuspended(command.worker_id, command.reason, command.strikes, list(command.request_ids))
            postings = []
        case RecordWorkerResumption():
            event, postings = ev.WorkerResumed(**command_fields(command)), []
        case RecordInvoice():
            event, postings = ev.InvoiceIssued(**command_fields(command)), []
        case RequestPayout() | RecordPayoutSent() | SettlePayout() | FailPayout():
            event, postings = _payout(command, book)
        case _:
            raise InvalidInput(f"unknown command {type(command).__name__}")
    return event, postings


def prepare_settlement(command: SettleRequest, book: BookView) -> tuple[ev.RequestSettled, list[ev.Posting]]:
    """`prepare` of a settlement, which a batch calls for most of its commands."""
    hold_id, owner, charge, request_id, _, meta, final = command  # a tuple: unpacked once, not read field by field
    hold = book.hold(hold_id)
    if not hold.active:
        raise HoldNotActive(f"hold {hold.hold_id} is no longer active")
    if charge > hold.amount_nano_usd:
        raise CaptureExceedsHold(f"charge {charge} exceeds hold {hold.hold_id} of {hold.amount_nano_usd}")
    if book.kind(owner) != OWNER:
        _require_kind(book, owner, OWNER)
    platform = book.system_account(PLATFORM_REVENUE_ACCOUNT)
    owner_nano_usd, platform_nano_usd = split_charge(charge)
    if owner_nano_usd + platform_nano_usd != charge:  # the postings' sum, as `prepare` checks any event's
        raise InvariantBroken("RequestSettled postings do not sum to zero")
    # hold_id, customer_account_id, owner_account_id, charge_nano_usd, owner_nano_usd,
    # platform_nano_usd, released_nano_usd, request_id, meta: by position, once per request.
    # A capture that is not final releases nothing: the rest stays held for the next.
    event = ev.settled_of((hold.hold_id, hold.account_id, owner, charge, owner_nano_usd, platform_nano_usd,
                           hold.amount_nano_usd - charge if final else 0, request_id, dict(meta)))
    postings = [
        ev.posting_of((hold.account_id, -charge)),
        ev.posting_of((owner, owner_nano_usd)),
        ev.posting_of((platform, platform_nano_usd)),
    ]
    return event, postings


def _payout(command: RequestPayout | RecordPayoutSent | SettlePayout | FailPayout, book: BookView) -> tuple[object, list[ev.Posting]]:
    """A payout's step: earnings to in flight, in flight to the rail (its fee to the platform) or back."""
    if isinstance(command, RecordPayoutSent):
        return ev.PayoutSent(command.payout_id, command.rail, command.reference, dict(command.meta)), []
    _require_kind(book, command.owner_account_id, OWNER)
    owner, amount = command.owner_account_id, command.amount_nano_usd
    in_flight = book.system_account(payouts_in_flight_account(command.rail))
    match command:
        case RequestPayout():
            event = ev.PayoutRequested(command.payout_id, owner, command.rail, amount, command.fee_nano_usd, command.destination)
            return event, [ev.Posting(owner, -amount), ev.Posting(in_flight, amount)]
        case SettlePayout():
            fee = command.fee_nano_usd
            event = ev.PayoutSettled(command.payout_id, owner, command.rail, amount, fee, command.reference)
            postings = [ev.Posting(in_flight, -amount), ev.Posting(book.system_account(payouts_paid_account(command.rail)), amount - fee)]
            if fee:
                postings.append(ev.Posting(book.system_account(PLATFORM_REVENUE_ACCOUNT), fee))
            return event, postings
        case _:
            event = ev.PayoutFailed(command.payout_id, owner, command.rail, amount, command.reason)
            return event, [ev.Posting(in_flight, -amount), ev.Posting(owner, amount)]


def _reverse(command: ReverseEvent, book: BookView) -> tuple[ev.EventReversed, list[ev.Posting]]:
    event_type, original = book.event_postings(command.seq)
    if event_type == "EventReversed":
        raise NotReversible(f"event {command.seq} is itself a reversal")
    if not original:
        raise NotReversible(f"event {command.seq} moved no money")
    if book.reversal_of(command.seq) is not None:
        raise NotReversible(f"event {command.seq} was already reversed by event {book.reversal_of(command.seq)}")
    postings = [ev.Posting(p.account_id, -p.amount_nano_usd) for p in original]
    return ev.EventReversed(command.seq, command.reason), postings


def _require_kind(book: BookView, account_id: int, kind: str) -> None:
    actual = book.kind(account_id)
    if actual != kind:
        raise WrongAccountKind(f"account {account_id} is {a_or_an(actual)} account, not {a_or_an(kind)} account")


def require_covered(book: BookView, event: object, postings: list[ev.Posting]) -> None:
    """No customer's available balance, and no owner's or platform's balance, goes below zero.

    A settlement's debit is covered by its own hold, so it is checked against
    credits alone; any other debit must also leave every active hold covered."""
    if isinstance(event, (ev.CreditsRefunded, ev.CreditsFrozen)):
        return  # the money has left (or is claimed) already; a shortfall is the customer's debt
    if type(event) is ev.RequestSettled:
        if (shortfall := settlement_shortfall(book.balance(event.customer_account_id), event)) is not None:
            raise shortfall
        return
    for posting in postings:
        if posting.amount_nano_usd >= 0:
            continue
        kind = book.kind(posting.account_id)
        if kind not in NON_NEGATIVE_KINDS:
            continue
        after = book.balance(posting.account_id) + posting.amount_nano_usd
        if kind == CUSTOMER:  # outside a hold: every active hold must stay covered too
            after -= book.held(posting.account_id)
        if after < 0:
            raise InsufficientFunds(
                f"account {posting.account_id} would go {-after} nano-USD below zero"
            )


def settlement_shortfall(customer_balance_nano_usd: int, event: ev.RequestSettled) -> InsufficientFunds | None:
    """`require_covered` of a settlement, returned rather than raised (a batch
    checks most of its commands so): its debit is covered by its own hold, so
    only its customer's credits are checked; its owner and the platform are
    only credited."""
    after = customer_balance_nano_usd - event.charge_nano_usd
    if after < 0:
        return InsufficientFunds(f"account {event.customer_account_id} would go {-after} nano-USD below zero")
    return None
