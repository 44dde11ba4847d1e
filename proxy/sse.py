"""Server-sent events, read as the WHATWG HTML standard defines the
event-stream format (section 9.2.6) and written as the OpenAI API streams them.

Reading: lines end in LF, CR or CRLF (a CRLF may be split across two
pieces); a line starting with ':' is a comment; `data` lines are joined with
LF; `event`, `id` and `retry` are kept; a blank line dispatches the event,
unless its data is empty; an event the stream ends before dispatching is
discarded. Bytes are kept as bytes: every delimiter is ASCII, so no UTF-8
sequence is ever cut.

Most workers send one whole `data: ` event per piece; such a piece is handed
over without parsing it line by line, which is what keeps the relay cheap.
"""
from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import NamedTuple

import orjson

from proxy.limits import SSE_EVENT_BYTES_MAX

DONE = b"[DONE]"
_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
DATA_PREFIX = b"data: "  # how every event this proxy writes starts
_DATA_PREFIX_BYTES = len(DATA_PREFIX)
EVENT_END = b"\n\n"  # how every event this proxy writes ends
_EVENT_END_BYTES = len(EVENT_END)
DONE_EVENT = DATA_PREFIX + DONE + EVENT_END


class Event(NamedTuple):
    data: bytes
    event: str = "message"
    id: str = ""  # the last event id, as the stream set it so far
    retry_ms: int | None = None  # the reconnection time the stream asked for so far


class EventStreamParser:
    """Incremental: `feed` pieces as they arrive, get back the events they complete."""

    __slots__ = ("_after_cr", "_data", "_data_bytes", "_event", "_started", "_tail", "last_event_id", "retry_ms")

    def __init__(self) -> None:
        self._tail = b""  # an unfinished line
        self._after_cr = False  # the last piece ended in CR: an LF opening the next one is the same line end
        self._started = False  # a byte-order mark is skipped at the very start only
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._event = b""
        self.last_event_id = ""
        self.retry_ms: int | None = None

    @property
    def at_event_boundary(self) -> bool:
        """Nothing under way: a piece that is one whole `data: ` event needs no parsing."""
        return self._started and not (self._tail or self._data or self._event or self._after_cr)

    def feed(self, piece: bytes) -> list[Event]:
        if not self._started:
            piece = self._skip_bom(piece)
            if not self._started:
                return []
        if self._after_cr and piece[:1] == b"\n":
            piece = piece[1:]
        self._after_cr = piece[-1:] == b"\r"
        buffer = self._tail + piece if self._tail else piece
        lines = _LINE_END.split(buffer) if b"\r" in buffer else buffer.split(b"\n")
        self._tail = lines.pop()
        events = []
        for line in lines:
            if line[:_DATA_PREFIX_BYTES] == DATA_PREFIX:  # the common line, without the general split
                self._data.append(line[_DATA_PREFIX_BYTES:])
                self._data_bytes += len(line) - _DATA_PREFIX_BYTES + 1
            elif line:
                self._field(line)
            elif self._data:
                events.append(self._dispatch())
            else:  # a blank line with no data dispatches nothing
                self._event = b""
        if len(self._tail) + self._data_bytes > SSE_EVENT_BYTES_MAX:
            raise ValueError("an upstream event exceeded the size limit")
        return events

    def _skip_bom(self, piece: bytes) -> bytes:
        """Wait until the first bytes can tell whether they are a byte-order mark."""
        head = self._tail + piece
        if len(head) < len(_BOM) and _BOM.startswith(head):
            self._tail = head
            return b""
        self._tail, self._started = b"", True
        return head[len(_BOM):] if head.startswith(_BOM) else head

    def _field(self, line: bytes) -> None:
        if line[:1] == b":":  # a comment
            return
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._data_bytes += len(value) + 1
        elif name == b"event":
            self._event = value
        elif name == b"id":
            if b"\0" not in value:
                self.last_event_id = value.decode(errors="replace")
        elif name == b"retry":
            if value.isdigit():
                self.retry_ms = int(value)

    def _dispatch(self) -> Event:
        data, event_type = self._data, self._event
        self._data, self._data_bytes, self._event = [], 0, b""
        joined = data[0] if len(data) == 1 else b"\n".join(data)
        return Event(joined, event_type.decode(errors="replace") or "message", self.last_event_id, self.retry_ms)


async def events(raw: AsyncIterator[bytes]) -> AsyncIterator[Event]:
    """Every event of a stream, in order."""
    parser = EventStreamParser()
    async for piece in raw:
        for event in parser.feed(piece):
            yield event


class DataReader:
    """Each event's data, as bytes, in order (`[DONE]` included), from pieces
    fed as they arrive: synchronous, so that the relay can read a worker's
    stream in the socket's own read callback."""

    __slots__ = ("_at_boundary", "_parser")

    def __init__(self) -> None:
        self._parser = EventStreamParser()
        self._at_boundary = False

    def feed(self, piece: bytes) -> list[bytes]:
        # One whole `data: ` event, LF-terminated, arriving when nothing is under way: as it is.
        if (self._at_boundary and piece[:_DATA_PREFIX_BYTES] == DATA_PREFIX
                and piece.find(b"\n") == len(piece) - _EVENT_END_BYTES and piece[-1:] == b"\n" and b"\r" not in piece):
            return [piece[_DATA_PREFIX_BYTES:-_EVENT_END_BYTES]]
        data = [event.data for event in self._parser.feed(piece)]
        self._at_boundary = self._parser.at_event_boundary
        return data


def encode(payload: dict) -> bytes:
    return DATA_PREFIX + orjson.dumps(payload) + EVENT_END
