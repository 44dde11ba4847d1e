"""Request ids that sort in the order they were made: a prefix, the time in
milliseconds (12 hex digits), then 80 random bits (20 hex digits).

A request's id ends its hold's key and its settlement's key, and both keys go
into unique B-tree indexes (of `holds` and `ledger_events`). A random id
(UUIDv4, before) sends each key to a random leaf of each index, a page that
is rarely in cache and often full of keys already closed, which splits; an
id that starts with the time sends it to the right edge, where the last keys
went. Ids made in the same millisecond sort among themselves at random, which
costs nothing: they go to the same leaf. Measured in README ("The proxy's own
request ids and keys").

The random bits are read from the system a few kilobytes at a time, not at
every id: `os.urandom` lets other threads take the interpreter for its system
call, and an event loop that starts a burst of requests then hands it to the
ledger's writer threads at every id, each of which takes a batch of a few
holds where it would have taken them all. The `uuid6` package's UUIDv7 was
tried and left: to keep its ids strictly increasing it adds a millisecond to
the last one whenever the clock has not moved, so under load its time runs
ahead of the clock (a second ahead per thousand ids made in one millisecond).
"""
from __future__ import annotations

import os
import threading
import time

from proxy.limits import NS_PER_MS, REQUEST_ID_RANDOM_BYTES, REQUEST_IDS_PER_RANDOM_READ

_lock = threading.Lock()
_random = b""
_taken = 0


def _forget_random() -> None:
    """A forked child reads its own: the parent's bytes left unused would make
    the parent's next ids. Its lock is new too: another thread of the parent
    may have held the old one at the fork, and would never release it here."""
    global _lock, _random, _taken
    _lock, _random, _taken = threading.Lock(), b"", 0


os.register_at_fork(after_in_child=_forget_random)


def _random_hex() -> str:
    global _random, _taken
    with _lock:
        start = _taken
        if start + REQUEST_ID_RANDOM_BYTES > len(_random):
            _random, start = os.urandom(REQUEST_ID_RANDOM_BYTES * REQUEST_IDS_PER_RANDOM_READ), 0
        _taken = start + REQUEST_ID_RANDOM_BYTES
        return _random[start:_taken].hex()


def new_request_id(prefix: str) -> str:
    """`prefix` (the API's: "chatcmpl-", "cmpl-", "embd-", "resp_") and 32 hex digits, later ids after earlier."""
    return f"{prefix}{time.time_ns() // NS_PER_MS:012x}{_random_hex()}"
