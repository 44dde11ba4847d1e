"""A settlement's texts written directly are the generic functions' own, byte for byte.

The hash chain and the idempotency digests are over these bytes: a difference
would make `verify` refuse the log, or a retry look like a conflict.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger import commands as cmd
from ledger import events as ev
from ledger.errors import InvalidInput
from ledger.limits import INT64_MAX
from ledger.money import split_charge
from ledger.settlement_texts import settle_texts, settled_texts

PLATFORM_ACCOUNT = 3
ids = st.integers(min_value=0, max_value=INT64_MAX)
# Any text the shape check lets through: escapes, quotes, non-ASCII, DEL, astral characters.
texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=40)
meta_values = st.one_of(st.integers(min_value=-INT64_MAX, max_value=INT64_MAX), texts, st.booleans(), st.none())


def _generic(command: cmd.SettleRequest, customer: int, hold_nano_usd: int):
    event, postings = _settled(command, customer, hold_nano_usd)
    payload = ev.canonical_json(ev.event_payload(event))
    return cmd.command_digest(command), payload, ev.hashed_parts("RequestSettled", command.idempotency_key, payload, postings)


def _settled(command: cmd.SettleRequest, customer: int, hold_nano_usd: int):
    owner_share, platform_share = split_charge(command.charge_nano_usd)
    released = hold_nano_usd - command.charge_nano_usd if command.final_capture else 0
    event = ev.RequestSettled(command.hold_id, customer, command.owner_account_id, command.charge_nano_usd, owner_share,
                              platform_share, released, command.request_id, dict(command.meta))
    postings = [ev.Posting(customer, -command.charge_nano_usd), ev.Posting(command.owner_account_id, owner_share),
                ev.Posting(PLATFORM_ACCOUNT, platform_share)]
    return event, postings


@settings(max_examples=300, deadline=None)
@given(hold_id=ids, owner=ids, customer=ids, charge=st.integers(min_value=1, max_value=10**18),
       extra_nano_usd=st.integers(min_value=0, max_value=10**18), request_id=texts, key=texts,
       meta=st.dictionaries(texts, meta_values, max_size=5), final=st.booleans())
def test_a_settlement_written_directly_is_written_as_the_generic_functions_write_it(
        hold_id, owner, customer, charge, extra_nano_usd, request_id, key, meta, final):
    command = cmd.SettleRequest(hold_id, owner, charge, request_id, key, meta, final)
    written = settle_texts(command)
    assert written is not None
    event, postings = _settled(command, customer, charge + extra_nano_usd)
    payload, hashed = settled_texts(event, postings, written)
    assert (written.digest, payload, hashed) == _generic(command, customer, charge + extra_nano_usd)


def test_the_bench_settlement_hashes_as_the_generic_path_hashes_it():
    """One fixed settlement, through the whole chained hash, against its bytes as the generic path makes them."""
    command = cmd.SettleRequest(41, 7, 195_000, "req:0.1:2", "s:0.1:2", {"model": "bench", "prompt_tokens": 902, "cached": None})
    written = settle_texts(command)
    event, postings = _settled(command, 12, 5_000_000)
    payload, hashed = settled_texts(event, postings, written)
    at = "2026-12-03T04:00:00.000000Z"
    assert ev.chained_hash(ev.GENESIS_HASH.hex(), 1, at, hashed) == ev.event_hash(
        ev.GENESIS_HASH, 1, "RequestSettled", "s:0.1:2", at, ev.canonical_json(ev.event_payload(event)), postings)
    assert payload == ('{"charge_nano_usd":195000,"customer_account_id":12,"hold_id":41,'
                       '"meta":{"cached":null,"model":"bench","prompt_tokens":902},"owner_account_id":7,'
                       '"owner_nano_usd":156000,"platform_nano_usd":39000,"released_nano_usd":4805000,"request_id":"req:0.1:2"}')


def test_a_settlement_with_a_value_that_is_no_plain_64_bit_integer_takes_the_generic_path():
    for hold_id, owner, charge in ((True, 7, 1), (1, 2**64, 1), (1, 7, -1), (1.0, 7, 1), ("1", 7, 1)):
        assert settle_texts(cmd.SettleRequest(hold_id, owner, charge, "r", "k")) is None


def test_a_final_capture_keeps_the_digest_settlements_had_before_the_flag_and_one_that_is_not_final_differs():
    """A retry across an upgrade still finds its settlement (`exists`, not a conflict): the default flag is no content."""
    before = ev.content_digest("SettleRequest", {"hold_id": 41, "owner_account_id": 7, "charge_nano_usd": 195_000,
                                                 "request_id": "req:0.1:2", "meta": {"model": "bench"}})
    final = cmd.SettleRequest(41, 7, 195_000, "req:0.1:2", "s:0.1:2", {"model": "bench"})
    not_final = final._replace(final_capture=False)
    assert cmd.command_digest(final) == settle_texts(final).digest == before
    assert cmd.command_digest(not_final) == settle_texts(not_final).digest != before


def test_a_final_capture_flag_that_is_no_bool_is_refused():
    for flag in (0, 1, None, "false"):
        command = cmd.SettleRequest(1, 2, 10, "r", "k", {}, flag)
        assert settle_texts(command) is None
        with pytest.raises(InvalidInput, match="final_capture"):
            cmd.validate_shape(command)
