"""POST /v1/embeddings on the simulated worker, in vLLM's shapes.

Each input's vector is a function of the input alone (SHAKE-256 of its bytes,
or of its token ids, as signed 32-bit integers, scaled to unit length), so a
test can compute what the caller must receive. The vectors are
SIM_EMBEDDING_DIMENSIONS long, or as many as `dimensions` asks for up to that
(a Matryoshka model); more is vLLM's 400.

Usage is honest: an input's prompt tokens are its UTF-8 bytes //
SIM_PROMPT_BYTES_PER_TOKEN plus SIM_EMBEDDING_TOKENS_PER_INPUT (CLS and SEP),
or its number of token ids; the worker's `inflate_usage` multiplies it (a
dishonest worker), as it does for chat.

`fault` (an attribute tests set on the route, `route_of(app).fault`) makes
every answer go wrong before the caller could use it: "fail" (a 500),
"wrong_count" (one vector fewer than inputs), "bad_json" (a body that is not
JSON)."""
from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from proxy.limits import SIM_EMBEDDING_DIMENSIONS, SIM_EMBEDDING_TOKENS_PER_INPUT, SIM_PROMPT_BYTES_PER_TOKEN
from proxy.sim.emitters import JSON_HEADERS, send_body
from proxy.sim.requests import HttpError, bad_request, read_body_for_model

PATH = "/v1/embeddings"
FAULTS = ("fail", "wrong_count", "bad_json")
INT32 = "<{}i"
FLOAT32 = "<{}f"


def vector_of(item: str | list[int], dimensions: int = SIM_EMBEDDING_DIMENSIONS) -> list[float]:
    """The simulated model's embedding of one input: deterministic, unit length."""
    data = item.encode() if isinstance(item, str) else orjson.dumps(item)
    width_bytes = struct.calcsize(INT32.format(dimensions))
    raw = struct.unpack(INT32.format(dimensions), hashlib.shake_256(data).digest(width_bytes))
    norm = math.sqrt(sum(float(x) * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def prompt_tokens_of(item: str | list[int]) -> int:
    if isinstance(item, str):
        return len(item.encode()) // SIM_PROMPT_BYTES_PER_TOKEN + SIM_EMBEDDING_TOKENS_PER_INPUT
    return len(item)


class EmbeddingRoute:
    """The route's handler (an ASGI callable on the worker's `_routes`)."""

    def __init__(self, worker: Any, read_body: Callable[[Any], Awaitable[bytes]]) -> None:
        self.worker = worker  # the SimWorker: its model and inflate_usage
        self.read_body = read_body  # the worker's bounded body reader
        self.fault: str | None = None
        self.requests_served = 0
        self.requests_failed = 0  # answered with the "fail" fault

    async def __call__(self, scope: dict, receive, send) -> None:
        try:
            body = await self.read_body(receive)
        except ConnectionResetError:
            return
        except HttpError as error:
            await send_body(send, error.status, error.body(), JSON_HEADERS)
            return
        if self.fault == "fail":
            self.requests_failed += 1
            error = HttpError(500, "InternalServerError", "Simulated failure before answering.")
            await send_body(send, error.status, error.body(), JSON_HEADERS)
            return
        try:
            answer = self.answer(body)
        except HttpError as error:
            await send_body(send, error.status, error.body(), JSON_HEADERS)
            return
        self.requests_served += 1
        await send_body(send, 200, self._faulty(answer), JSON_HEADERS)

    def answer(self, body: bytes) -> dict[str, Any]:
        data = _request(body, self.worker.model)
        inputs = data["input"] if isinstance(data["input"], list) and not _token_ids(data["input"]) else [data["input"]]
        width = _width(data.get("dimensions"))
        as_base64 = data.get("encoding_format") == "base64"
        vectors = [_encoded(vector_of(item, width), as_base64) for item in inputs]
        tokens = sum(prompt_tokens_of(item) for item in inputs) * self.worker.inflate_usage
        return {
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": self.worker.model,
            "data": [{"index": i, "object": "embedding", "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None},
        }

    def _faulty(self, answer: dict) -> bytes:
        if self.fault == "wrong_count":
            answer["data"] = answer["data"][:-1]
        if self.fault == "bad_json":
            return orjson.dumps(answer)[:-1]
        return orjson.dumps(answer)


def route_of(worker: Any) -> EmbeddingRoute:
    """The embeddings route of a simulated worker, whose `fault` a test may set."""
    return worker._routes[PATH][1]


def _request(body: bytes, model: str) -> dict:
    data = read_body_for_model(body, model)
    value = data.get("input")
    if isinstance(value, str) and value:
        return data
    if isinstance(value, list) and value and (_token_ids(value) or all(_input(item) for item in value)):
        return data
    raise bad_request("input must be a string, a list of strings, token ids or lists of token ids")


def _input(item: object) -> bool:
    return (isinstance(item, str) and bool(item)) or (isinstance(item, list) and bool(item) and _token_ids(item))


def _token_ids(value: list) -> bool:
    return all(type(t) is int and t >= 0 for t in value)


def _width(dimensions: object) -> int:
    if dimensions is None:
        return SIM_EMBEDDING_DIMENSIONS
    if type(dimensions) is not int or not 1 <= dimensions <= SIM_EMBEDDING_DIMENSIONS:
        raise bad_request(f"dimensions must be from 1 to {SIM_EMBEDDING_DIMENSIONS}: the model does not support more")
    return dimensions


def _encoded(vector: list[float], as_base64: bool) -> list[float] | str:
    if not as_base64:
        return vector
    return base64.b64encode(struct.pack(FLOAT32.format(len(vector)), *vector)).decode()
