"""Events: what happened, named in the past tense, and how each is hashed.

An event is stored as one `ledger_events` row (type, canonical JSON payload,
idempotency key, time, hash chain) plus its postings, which sum to zero.
Events are named tuples: immutable, and one is built per settlement, where a
frozen dataclass cost the durable writer 3 µs each (one `object.__setattr__`
per field) and a tuple costs under 1.
"""
from __future__ import annotations

import functools
import hashlib
from datetime import UTC, datetime
from typing import NamedTuple

import orjson

from ledger.limits import EVENT_TYPES_CACHED_MAX, SHA256_BYTES

GENESIS_HASH = bytes(SHA256_BYTES)


class Posting(NamedTuple):
    """One leg of an event. A tuple, so a batch of thousands builds them cheaply."""

    account_id: int
    amount_nano_usd: int  # positive raises the account's balance, negative lowers it


# A Posting from an (account_id, amount_nano_usd) pair, built without the
# Python frame of the class's generated __new__: about half its cost, for the
# legs of every settlement.
posting_of = functools.partial(tuple.__new__, Posting)


class CreditsGranted(NamedTuple):
    """An operator gave a customer credits (promotion, goodwill, migration)."""

    account_id: int
    amount_nano_usd: int
    reason: str


class CreditsPurchased(NamedTuple):
    """A customer paid for credits (card through Stripe, or a stablecoin on a chain)."""

    account_id: int
    amount_nano_usd: int
    payment_method: str  # "card" or "crypto"
    external_reference: str  # Stripe session and event, or chain, transaction and log index


class CreditsRefunded(NamedTuple):
    """Money paid for credits went back to the payer. Taken from unspent credits;
    what was already spent leaves the balance below zero: a debt that blocks
    new requests until a top-up repays it."""

    account_id: int
    amount_nano_usd: int
    payment_method: str
    external_reference: str


class CreditsFrozen(NamedTuple):
    """A payment is disputed: its amount is set aside until the dispute closes
    (won: this event is reversed; lost: `FrozenCreditsForfeited`). Like a
    refund, it may leave a debt where the credits were spent."""

    account_id: int
    amount_nano_usd: int
    external_reference: str


class FrozenCreditsForfeited(NamedTuple):
    """A dispute was lost: the frozen amount went back to the payer."""

    account_id: int
    amount_nano_usd: int
    external_reference: str


class BalanceAdjusted(NamedTuple):
    """An operator corrected a balance up or down, with a mandatory reason."""

    account_id: int
    delta_nano_usd: int
    reason: str


class RequestSettled(NamedTuple):
    """One inference request was charged: 80% to the GPU owner, the rest to the platform."""

    hold_id: int
    customer_account_id: int
    owner_account_id: int
    charge_nano_usd: int
    owner_nano_usd: int
    platform_nano_usd: int
    released_nano_usd: int
    request_id: str
    meta: dict  # model, tokens, worker: integers, strings, booleans and null only


settled_of = functools.partial(tuple.__new__, RequestSettled)  # from a 9-tuple, as posting_of: one per request


class UsageDiscrepancyRecorded(NamedTuple):
    """A worker reported more tokens than the proxy could count; the lower was billed.
    Moves no money: it is the audit trail for a charge below what a worker claimed."""

    request_id: str
    worker_id: int
    reported_prompt_tokens: int
    reported_completion_tokens: int
    billed_prompt_tokens: int
    billed_completion_tokens: int
    customer_account_id: int  # whose request it was: inflation counts only across several accounts
    reason: str  # e.g. "completion_above_count", "prompt_above_bound"


class WorkerSuspended(NamedTuple):
    """A worker was taken out of routing after `strikes` usage strikes; the
    request ids are the evidence (each has its `UsageDiscrepancyRecorded`). Moves no money."""

    worker_id: int
    reason: str
    strikes: int
    request_ids: list[str]


class WorkerResumed(NamedTuple):
    """An operator returned a suspended worker to routing; its strikes start again from zero. Moves no money."""

    worker_id: int
    resumed_by: str
    reason: str
    strikes_cleared: int


class InvoiceIssued(NamedTuple):
    """An invoice or credit note was issued for a ledger event; the hash of its
    PDF is kept on the chain, so the document can be proven unaltered. Moves no money."""

    number: str
    kind: str
    source_seq: int
    account_id: int
    amount_nano_usd: int
    pdf_sha256: str  # hex


class PayoutRequested(NamedTuple):
    """An owner asked for earnings to be paid out: the amount leaves the owner's
    earnings for the rail's payouts in flight, so it cannot be spent twice."""

    payout_id: int
    owner_account_id: int
    rail: str  # "usdc" or "stripe"
    amount_nano_usd: int
    fee_nano_usd: int  # the rail's fee, taken when the payout settles
    destination: str  # the address or connected account it goes to


class PayoutSent(NamedTuple):
    """The rail accepted the payout: its reference (a transaction hash, a Stripe
    transfer id). A replaced transaction is sent again with a new hash. Moves no money."""

    payout_id: int
    rail: str
    reference: str
    meta: dict  # nonce, raw on-chain amount: integers and strings


class PayoutSettled(NamedTuple):
    """The payout is final on its rail: in flight to the rail's counter-account, the fee to the platform."""

    payout_id: int
    owner_account_id: int
    rail: str
    amount_nano_usd: int
    fee_nano_usd: int
    reference: str


class PayoutFailed(NamedTuple):
    """The payout was not made (or was reversed by the rail): the whole amount is the owner's again."""

    payout_id: int
    owner_account_id: int
    rail: str
    amount_nano_usd: int
    reason: str


class EventReversed(NamedTuple):
    """A former event's postings, negated. The only way a mistake is undone."""

    reversed_seq: int
    reason: str


def event_payload(event: NamedTuple) -> dict:
    """Shallow on purpose: payload values are ints, strings, one flat `meta` dict and lists of strings."""
    return dict(zip(event._fields, event))


_SORTED = orjson.OPT_SORT_KEYS


def canonical_bytes(value: object) -> bytes:
    """One UTF-8 text per value: keys sorted, no spaces, strings with the same
    escapes as the standard library's json (callers keep floats out). orjson
    refuses what has no single form: lone surrogates, integers past 64 bits,
    keys that are not strings."""
    try:
        return orjson.dumps(value, option=_SORTED)
    except orjson.JSONEncodeError as exc:
        raise TypeError(f"not canonical JSON: {exc}") from None


def canonical_json(value: object) -> str:
    return canonical_bytes(value).decode()


def format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@functools.lru_cache(maxsize=EVENT_TYPES_CACHED_MAX)
def _type_json(event_type: str) -> str:
    """An event type's JSON: a handful of names, hashed into every event."""
    return canonical_json(event_type)


def event_hash(
    prev_hash: bytes,
    seq: int,
    event_type: str,
    idempotency_key: str,
    recorded_at_text: str,
    payload_json: str,
    postings: list[tuple[int, int]],
) -> bytes:
    """SHA-256 over the previous hash and the canonical event, postings included.

    `recorded_at_text` is `format_time(recorded_at)`; callers hashing a batch
    format the shared timestamp once."""
    return chained_hash(prev_hash.hex(), seq, recorded_at_text, hashed_parts(event_type, idempotency_key, payload_json, postings))


def hashed_parts(event_type: str, idempotency_key: str, payload_json: str, postings: list[tuple[int, int]]) -> tuple[str, str]:
    """The canonical event's text around its sequence and time, which only the
    append lock decides: an append builds these before it takes the lock."""
    legs = ",".join([f"[{account_id},{amount}]" for account_id, amount in postings])
    return (f',"type":{_type_json(event_type)},"key":{canonical_json(idempotency_key)},"at":"',
            f'","payload":{payload_json},"postings":[{legs}]}}')


def chained_hash(prev_hash_hex: str, seq: int, recorded_at_text: str, parts: tuple[str, str]) -> bytes:
    """The previous hash comes in hex, as it is hashed: an append hexes each hash once, for this and for its write."""
    return hashlib.sha256(f'{prev_hash_hex}\n{{"seq":{seq}{parts[0]}{recorded_at_text}{parts[1]}'.encode()).digest()


def content_digest(kind: str, fields: dict) -> bytes:
    """What an idempotency key is compared on: the command's own content."""
    return hashlib.sha256(kind.encode() + b"\n" + canonical_bytes(fields)).digest()
