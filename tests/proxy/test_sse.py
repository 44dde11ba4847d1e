"""The SSE reader against the event-stream format of the WHATWG HTML standard
(9.2.6): line ends, multi-line data, comments, fields, dispatch, and pieces
split anywhere. No servers: the relay's reader is fed pieces, `events` takes any async iterator of bytes."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import sse
from proxy.limits import SSE_EVENT_BYTES_MAX


async def _pieces(pieces: list[bytes]):
    for piece in pieces:
        yield piece


def data_of(*pieces: bytes) -> list[bytes]:
    """What the relay reads of a stream arriving in these pieces."""
    reader = sse.DataReader()
    return [data for piece in pieces for data in reader.feed(piece)]


def events_of(*pieces: bytes) -> list[sse.Event]:
    async def read() -> list[sse.Event]:
        return [event async for event in sse.events(_pieces(list(pieces)))]

    return asyncio.run(read())


OPENAI_STREAM = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'


def test_one_whole_event_per_piece_is_read_as_sent():
    assert data_of(b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b"data: [DONE]\n\n") == [b'{"a":1}', b'{"b":2}', sse.DONE]


@pytest.mark.parametrize("line_end", [b"\r\n", b"\r", b"\n"], ids=["CRLF", "CR", "LF"])
def test_lines_may_end_in_crlf_cr_or_lf(line_end):
    stream = OPENAI_STREAM.replace(b"\n", line_end)
    assert data_of(stream) == [b'{"a":1}', b'{"b":2}', sse.DONE]


def test_a_crlf_split_between_two_pieces_is_one_line_end():
    assert data_of(b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n") == [b"a", b"b"]


def test_multi_line_data_is_joined_with_line_feeds():
    assert data_of(b"data: first\ndata: second\r\ndata:third\n\n") == [b"first\nsecond\nthird"]


def test_comments_are_ignored_and_do_not_dispatch():
    assert data_of(b": keep-alive\n\n", b": ping\ndata: x\n: note\n\n") == [b"x"]


def test_only_one_space_after_the_colon_is_dropped():
    assert data_of(b"data:  two spaces\n\n", b"data:none\n\n") == [b" two spaces", b"none"]


def test_a_field_without_a_colon_has_an_empty_value():
    assert data_of(b"data\n\n", b"data\ndata\n\n") == [b"", b"\n"]


def test_a_blank_line_with_no_data_dispatches_nothing():
    assert data_of(b"\n\n\nevent: ping\n\nid: 7\n\n") == []


def test_event_id_and_retry_fields():
    events = events_of(b"event: usage\nid: 42\nretry: 1500\ndata: x\n\n", b"data: y\n\n", b"id\nretry: soon\ndata: z\n\n")
    assert events == [
        sse.Event(b"x", "usage", "42", 1500),
        sse.Event(b"y", "message", "42", 1500),  # the type resets; the last id and retry stay
        sse.Event(b"z", "message", "", 1500),  # an empty id resets it; a retry that is not digits is ignored
    ]


def test_an_id_holding_a_null_is_ignored():
    assert events_of(b"id: 1\n\nid: 2\0\ndata: x\n\n")[0].id == "1"


def test_unknown_fields_are_ignored():
    assert data_of(b"data: x\nfoo: bar\nDATA: shout\n\n") == [b"x"]


def test_an_event_the_stream_ends_before_dispatching_is_discarded():
    assert data_of(b"data: complete\n\ndata: cut") == [b"complete"]
    assert data_of(b"data: complete\n\ndata: cut\n") == [b"complete"]


def test_a_byte_order_mark_is_skipped_at_the_start_only():
    assert data_of(b"\xef\xbb", b"\xbfdata: x\n\n") == [b"x"]
    assert data_of(b"data: x\n\n", b"\xef\xbb\xbfdata: y\n\n") == [b"x"]  # later, it makes the field unknown


def test_utf8_data_survives_any_split():
    text = "data: héllo wörld ✓\n\n".encode()
    for cut in range(1, len(text)):
        assert data_of(text[:cut], text[cut:]) == ["héllo wörld ✓".encode()]


def test_an_event_above_the_size_limit_is_refused():
    with pytest.raises(ValueError, match="size limit"):
        data_of(b"data: " + b"x" * SSE_EVENT_BYTES_MAX, b"x\n")


def test_what_the_relay_writes_reads_back():
    payload = {"choices": [{"delta": {"content": "line one\nline two\r\n"}}]}
    assert data_of(sse.encode(payload), sse.DONE_EVENT) == [sse.encode(payload)[6:-2], sse.DONE]


# --- any stream, cut anywhere ---------------------------------------------------

_text = st.text(st.characters(blacklist_characters="\r\n\0", blacklist_categories=("Cs",)), max_size=20)
_line_ends = st.sampled_from(["\n", "\r", "\r\n"])
_comment = st.builds(lambda text: ":" + text, _text)


@st.composite
def streams(draw) -> tuple[bytes, list[list[str]]]:
    """An event stream with random line ends and comments, and the data lines of each event."""
    events = draw(st.lists(st.lists(_text, min_size=1, max_size=4), max_size=6))
    parts: list[str] = []

    def line(text: str) -> None:
        end = draw(_line_ends)
        if parts and parts[-1].endswith("\r") and not text and end == "\n":
            end = "\r"  # CR then LF would be one line end, not two
        parts.append(text + end)

    for lines in events:
        for data in lines:
            if draw(st.booleans()):
                line(draw(_comment))
            line("data: " + data)
        line("")
    return "".join(parts).encode(), events


@settings(max_examples=300, deadline=None)
@given(streams(), st.lists(st.integers(min_value=0), max_size=8))
def test_any_stream_split_anywhere_reads_the_same(stream_and_events, cuts):
    stream, events = stream_and_events
    expected = ["\n".join(lines).encode() for lines in events]
    points = sorted({cut % (len(stream) + 1) for cut in cuts})
    pieces = [stream[start:end] for start, end in zip([0, *points], [*points, len(stream)])]
    assert data_of(*pieces) == expected
    assert data_of(stream) == expected
