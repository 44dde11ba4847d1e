"""Server-sent events as the OpenAI API streams them: `data: <json>` blocks."""
from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

from proxy.limits import SSE_EVENT_BYTES_MAX

DONE = b"[DONE]"


async def data_events(raw: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Each event's data payload, as bytes, in order (`[DONE]` included)."""
    buffer = b""
    async for piece in raw:
        # The common case, one whole `data:` event per piece, without copying.
        if not buffer and piece.startswith(b"data:") and piece.endswith(b"\n\n") and piece.count(b"\n") == 2:
            yield piece[5:-2].strip()
            continue
        buffer += piece
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            block, buffer = buffer[:end], buffer[end + 2 :]
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()
        if len(buffer) > SSE_EVENT_BYTES_MAX:
            raise ValueError("an upstream event exceeded the size limit")
    if buffer.strip().startswith(b"data:"):
        yield buffer.strip()[5:].strip()


def encode(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"
