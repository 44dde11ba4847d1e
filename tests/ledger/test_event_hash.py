"""The hash of an event is fixed forever: every log written so far is verified
with it. Computed here from its definition, with the standard library's json."""
import hashlib
import json

from ledger import events as ev

PREV_HASH = bytes(range(32))
POSTINGS = [(7, -1_500), (8, 1_200), (1, 300)]
PAYLOAD = {"request_id": "r-1", "meta": {"model": "m\u00e9", "ok": True, "prompt_tokens": 12}, "hold_id": 3}


def hash_by_definition(seq: int, event_type: str, key: str, at: str, payload: dict, postings: list) -> bytes:
    """SHA-256 over the previous hash in hex, a newline and the canonical event
    (keys in this order, compact, payload keys sorted, non-ASCII as written)."""
    compact = {"separators": (",", ":"), "ensure_ascii": False}
    body = (f'{{"seq":{seq},"type":{json.dumps(event_type, **compact)},"key":{json.dumps(key, **compact)},'
            f'"at":"{at}","payload":{json.dumps(payload, sort_keys=True, **compact)},'
            f'"postings":{json.dumps([list(p) for p in postings], **compact)}}}')
    return hashlib.sha256(f"{PREV_HASH.hex()}\n{body}".encode()).digest()


def test_an_events_hash_is_its_definition_whether_drafted_before_the_lock_or_computed_whole():
    key, at = 'settle:"r-1"\\', "2026-12-02T01:02:03.000004Z"
    payload_json = ev.canonical_json(PAYLOAD)
    expected = hash_by_definition(41, "RequestSettled", key, at, PAYLOAD, POSTINGS)
    assert ev.event_hash(PREV_HASH, 41, "RequestSettled", key, at, payload_json, POSTINGS) == expected
    drafted = ev.hashed_parts("RequestSettled", key, payload_json, POSTINGS)
    assert ev.chained_hash(PREV_HASH.hex(), 41, at, drafted) == expected
    assert ev.chained_hash(PREV_HASH.hex(), 42, at, drafted) != expected, "the sequence is hashed"
