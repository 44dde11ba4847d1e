"""A settlement's texts written directly, for the command a ledger appends most.

`command_digest`, `canonical_json(event_payload(...))` and `hashed_parts` make
any event's texts through a dict of its fields, sorted by `orjson`. A
settlement's keys are always the same, so its texts are written here in one
format string each, with `orjson` called only for the values that may need
escapes (the request id, the idempotency key, the metadata), and each of those
once for the digest and the event both. The bytes are the generic functions'
own (`tests/ledger/test_settlement_texts.py` compares them on generated
settlements); a settlement with any id or amount that is not a plain integer
of 64 bits gets `None` here and takes the generic path, which writes or refuses
it as it always did.
"""
from __future__ import annotations

import hashlib
from functools import partial
from typing import NamedTuple

import orjson

from ledger import commands as cmd
from ledger import events as ev
from ledger.limits import INT64_MAX

_SETTLED_TYPE_JSON = '"RequestSettled"'
_NOT_FINAL = '"final_capture":false,'
_dumps, _SORTED, _sha256 = orjson.dumps, orjson.OPT_SORT_KEYS, hashlib.sha256


class SettleTexts(NamedTuple):
    digest: bytes  # `command_digest` of the command
    meta_json: str
    request_id_json: str
    key_json: str


_texts_of = partial(tuple.__new__, SettleTexts)  # from a 4-tuple, as ev.posting_of: one per settlement


def settle_texts(command: cmd.SettleRequest) -> SettleTexts | None:
    """The command's digest and the JSON of its text values, or None: then
    the generic functions write it."""
    hold_id, owner, charge, request_id, key, meta, final = command  # a tuple: unpacked once, not read field by field
    # Integers that both str() and orjson write as their digits (a bool is no int here).
    if not (type(hold_id) is int and type(owner) is int and type(charge) is int
            and 0 <= hold_id <= INT64_MAX and 0 <= owner <= INT64_MAX and 0 <= charge <= INT64_MAX
            and type(final) is bool):
        return None
    # orjson as `ev.canonical_json` calls it, without its two frames: three values per settlement
    meta_json = _dumps(meta, option=_SORTED).decode()
    request_id_json = _dumps(request_id).decode()
    # `command_fields` leaves a final capture's flag out (the default), and sorts it between charge and hold.
    content = (f'SettleRequest\n{{"charge_nano_usd":{charge},{"" if final else _NOT_FINAL}"hold_id":{hold_id},'
               f'"meta":{meta_json},"owner_account_id":{owner},"request_id":{request_id_json}}}')
    return _texts_of((_sha256(content.encode()).digest(), meta_json, request_id_json, _dumps(key).decode()))


def settled_texts(event: ev.RequestSettled, postings: list[ev.Posting], texts: SettleTexts) -> tuple[str, tuple[str, str]]:
    """The event's payload JSON and its hashed parts (`ev.hashed_parts`), from
    the texts of the command it settles."""
    payload = (f'{{"charge_nano_usd":{event.charge_nano_usd},"customer_account_id":{event.customer_account_id},'
               f'"hold_id":{event.hold_id},"meta":{texts.meta_json},"owner_account_id":{event.owner_account_id},'
               f'"owner_nano_usd":{event.owner_nano_usd},"platform_nano_usd":{event.platform_nano_usd},'
               f'"released_nano_usd":{event.released_nano_usd},"request_id":{texts.request_id_json}}}')
    (customer, debit), (owner, owner_share), (platform, platform_share) = postings
    return payload, (f',"type":{_SETTLED_TYPE_JSON},"key":{texts.key_json},"at":"',
                     f'","payload":{payload},"postings":[[{customer},{debit}],[{owner},{owner_share}],[{platform},{platform_share}]]}}')
