"""Embeddings (POST /v1/embeddings, OpenAI's CreateEmbeddingRequest), billed
per input token at the model's input price, by the ledger's rules for chat
(DESIGN.md, A request through the proxy, and Metering rules):

- Only workers registered with the `embedding` task answer them (and only
  they: proxy/workers.py `for_task`).
- A hold for the input's bound (UTF-8 bytes plus the tokens an engine adds
  per input, or the token ids as sent) times the input price is placed
  before any worker is asked; nothing is clamped, so a balance that does not
  cover it is a 402.
- A worker that fails before answering (unreachable, an error status, an
  answer that is not JSON or has the wrong number of vectors) is replaced
  by the next one, and costs nothing; a worker's 400 is the caller's.
- The settlement charges min(usage.prompt_tokens, bound) input tokens, 80%
  to the worker's owner. A report above the bound is billed at the bound
  and recorded as a discrepancy, as for chat. No completion tokens here, yet
  the input is charged: chat's "an empty completion costs nothing" is not
  this rule.
- Nothing is delivered before the settlement is durable: an answer that
  cannot be billed is withheld and costs nothing (the Settler's rule for a
  non-streaming answer).

Workers are always asked for floats, and the proxy encodes base64 itself,
so every engine answers alike and the vectors can be checked. Token-id
inputs and `dimensions` go only to engines that take them (vLLM);
llama-cpp-python's server takes strings and ignores `dimensions`."""
from __future__ import annotations

import asyncio
import base64
import logging
import math
import struct
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

import orjson

from ledger import commands as cmd
from ledger.db import is_connection_failure
from ledger.errors import DatabaseUnavailable
from ledger.holds import PlaceHold, settlement_key
from ledger.money import nano_usd_to_usd_text
from ledger.schema import utc_now
from proxy import routing, unbilled
from proxy import workers as registry
from proxy.errors import (
    ContextTooLong,
    InvalidRequest,
    NoWorkerAvailable,
    NotReady,
    UnknownModel,
    UpstreamFailed,
    hold_refusal,
)
from proxy.keys import KeyGrant
from proxy.limits import (
    EMBEDDING_ANSWER_BYTES_MAX,
    EMBEDDING_DIMENSIONS_MAX,
    EMBEDDING_INPUTS_MAX,
    EMBEDDING_TOKENS_PER_INPUT,
    TEMPLATE_TOKENS_WITH_TOKEN_IDS,
    UPSTREAM_ATTEMPTS_MAX,
    UPSTREAM_REFUSAL_DETAIL_BYTES_MAX,
)
from proxy.prices import Price
from proxy.request_ids import new_request_id
from proxy.settlement import Settler, hold_key
from proxy.upstream import UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

EMBEDDINGS_PATH = "/v1/embeddings"
ENCODINGS = ("float", "base64")
ENGINES_WITH_TOKEN_IDS_AND_DIMENSIONS = ("vllm",)
FLOAT32 = "<{}f"  # OpenAI's base64: the vector's little-endian float32 bytes
FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]  # the largest finite float32


# The request
@dataclass(frozen=True, slots=True)
class EmbeddingAsk:
    model: str
    inputs: list  # strings, or lists of token ids: always a list upstream
    token_ids: bool
    base64: bool
    dimensions: int | None
    bound_tokens: int  # of all inputs: what the hold pays for
    longest_tokens: int  # of the largest input: each must fit a worker's context


def read_request(body: object) -> EmbeddingAsk:
    """The caller's body, checked against OpenAI's CreateEmbeddingRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", param="model")
    inputs, token_ids = _inputs(body.get("input"))
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise InvalidRequest("encoding_format must be float or base64", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or not 1 <= dimensions <= EMBEDDING_DIMENSIONS_MAX):
        raise InvalidRequest(f"dimensions must be an integer from 1 to {EMBEDDING_DIMENSIONS_MAX}", param="dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("user must be a string", param="user")
    bounds = [input_tokens_bound(item) for item in inputs]
    return EmbeddingAsk(model, inputs, token_ids, encoding == "base64", dimensions, sum(bounds), max(bounds))


def _inputs(value: object) -> tuple[list, bool]:
    """(the inputs as a list, whether they are token ids)."""
    if isinstance(value, str):
        value = [value]
    if type(value) is not list or not value:
        raise InvalidRequest("input must be a string, a list of strings, a list of token ids or a list of such lists",
                             param="input")
    if len(value) > EMBEDDING_INPUTS_MAX:
        raise InvalidRequest(f"input holds at most {EMBEDDING_INPUTS_MAX} items", param="input")
    if all(type(t) is int for t in value):  # one input of token ids
        value = [value]
    if all(isinstance(item, str) for item in value):
        if not all(value):
            raise InvalidRequest("input cannot be an empty string", param="input")
        return value, False
    if all(type(item) is list and item and all(type(t) is int and t >= 0 for t in item) for item in value):
        return value, True
    raise InvalidRequest("input must be strings, or non-empty lists of token ids (integers from 0), not a mix",
                         param="input")


def input_tokens_bound(item: str | list[int]) -> int:
    """No byte-level tokenizer makes more tokens than the bytes it is given;
    token ids are what they are, plus what an engine may add around them."""
    if isinstance(item, str):
        return len(item.encode()) + EMBEDDING_TOKENS_PER_INPUT
    return len(item) + TEMPLATE_TOKENS_WITH_TOKEN_IDS


# The worker's answer
class Malformed(Exception):
    """An answer that cannot be given to the caller: it is not billed."""


class Vectors(NamedTuple):
    vectors: list[list[float]]  # in the order of the inputs
    reported_prompt_tokens: int | None


def read_answer(raw: bytes, count: int, dimensions: int | None) -> Vectors:
    """One vector of numbers per input, all as long (as `dimensions` when asked), each index once."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise Malformed("the answer is not JSON") from None
    data = answer.get("data") if isinstance(answer, dict) else None
    if type(data) is not list or len(data) != count:
        raise Malformed(f"{len(data) if type(data) is list else 'no'} vectors for {count} inputs")
    vectors: list = [None] * count
    for item in data:
        index = item.get("index") if isinstance(item, dict) else None
        vector = item.get("embedding") if isinstance(item, dict) else None
        if type(index) is not int or not 0 <= index < count or vectors[index] is not None:
            raise Malformed("the vectors' indexes are not 0 to n-1, each once")
        if type(vector) is not list or not vector or not all(_float32(x) for x in vector):
            raise Malformed(f"vector {index} is not a list of 32-bit float numbers")
        vectors[index] = vector
    width = dimensions or len(vectors[0])
    if any(len(v) != width for v in vectors):
        raise Malformed(f"the vectors are not all {width} numbers long")
    usage = answer.get("usage")
    reported = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return Vectors(vectors, reported if type(reported) is int and reported >= 0 else None)


def _float32(x: object) -> bool:
    """A number a 32-bit float holds: base64 answers pack it, after the charge is written."""
    return (type(x) is float or type(x) is int) and math.isfinite(x) and abs(x) <= FLOAT32_MAX


def encoded(vector: list[float], as_base64: bool) -> list[float] | str:
    if not as_base64:
        return vector
    return base64.b64encode(struct.pack(FLOAT32.format(len(vector)), *vector)).decode()


# Billing
class Billed(NamedTuple):
    prompt_tokens: int
    cost_nano_usd: int
    over_reported: bool  # the worker reported more than the bound: a discrepancy


def billed_usage(reported: int | None, bound: int, price: Price) -> Billed:
    """The worker's report within the bound, else the bound (also when it reported nothing)."""
    tokens = bound if reported is None else min(reported, bound)
    return Billed(tokens, tokens * price.input_nano_usd_per_token, reported is not None and reported > bound)


@dataclass(eq=False)
class HeldRequest:
    """An embedding request's hold, as the Settler renews, releases or
    withholds it (the parts of a Generation it reads)."""
    hold_id: int
    request_id: str
    streaming: bool = False  # nothing is delivered before the answer is billed
    finished: bool = False
    withheld: bool = False

    def lose_hold(self) -> None:
        """The sweeper closed it: the settlement finds it closed and the answer is withheld."""

    def withhold(self) -> None:
        self.withheld = True


class Embedded(NamedTuple):
    request_id: str
    cost_nano_usd: int
    answer: dict


class _Retry(Exception):
    """This worker did not answer usefully: try the next one, at no charge."""


class _Attempted(NamedTuple):
    worker: registry.WorkerView
    vectors: Vectors


class Embeddings:
    """Runs beside the chat proxy, on its ledger, directory, workers' pool and Settler."""

    def __init__(self, proxy) -> None:  # an InferenceProxy (proxy/service.py)
        self.ledger = proxy.ledger
        self.directory = proxy.directory
        self.upstream: UpstreamPool = proxy.upstream
        self.settler: Settler = proxy.settler
        self.hold_ttl_s: int = proxy.hold_ttl_s
        self.replica_id: str | None = proxy.replica_id

    async def create(self, body: object, grant: KeyGrant) -> Embedded:
        ask = read_request(body)
        price, candidates = self._plan(ask)
        request_id, started_at = new_request_id("embd-"), utc_now()
        held = await self._hold(grant, request_id, ask.bound_tokens * price.input_nano_usd_per_token)
        try:
            attempted = await self._ask_workers(ask, candidates)
        except BaseException as exc:
            self._unbilled(request_id, grant, ask, None, *unbilled.ended_by(exc))
            if held is not None:
                await self.settler.release(held)
            raise
        billed = billed_usage(attempted.vectors.reported_prompt_tokens, ask.bound_tokens, price)
        if held is not None:  # its own task: a caller leaving now cannot interrupt the settlement
            await asyncio.shield(self.settler.in_background(self._settle(held, attempted.worker, grant, ask, billed, started_at)))
            if held.withheld:
                self._unbilled(request_id, grant, ask, attempted.worker.id, unbilled.FAILED, unbilled.WITHHELD)
                raise NotReady("the answer could not be billed just now, so it is withheld; nothing was charged: try again")
        if billed.over_reported:  # evidence is recorded off the caller's path
            self.settler.in_background(self._record_discrepancy(request_id, attempted, grant, billed))
        return Embedded(request_id, billed.cost_nano_usd, _answer(ask, attempted.vectors.vectors, billed))

    def _unbilled(self, request_id: str, grant: KeyGrant, ask: EmbeddingAsk, worker_id: int | None, status: str,
                  reason: str) -> None:
        self.settler.unbilled.record(request_id, grant, ask.model, worker_id, stream=False, ttft_ms=None,
                                     status=status, reason=reason)

    def _plan(self, ask: EmbeddingAsk) -> tuple[Price, list[registry.WorkerView]]:
        """The price and the workers that may answer: no I/O."""
        price = self.directory.prices.get(ask.model)
        fleet = registry.for_task(self.directory.fleet.get(ask.model), registry.EMBEDDING, ask.model)
        if price is None or not fleet:
            raise UnknownModel(f"The model `{ask.model}` does not exist")
        if ask.token_ids or ask.dimensions:
            fleet = [w for w in fleet if w.engine in ENGINES_WITH_TOKEN_IDS_AND_DIMENSIONS]
            if not fleet:
                param = "dimensions" if ask.dimensions else "input"
                raise InvalidRequest(f"no worker of `{ask.model}` takes {'dimensions' if ask.dimensions else 'token ids'}"
                                     f" (its engines take strings at the model's own size)", param=param)
        try:
            return price, routing.candidates(fleet, ask.longest_tokens)
        except ContextTooLong as exc:
            raise ContextTooLong(str(exc), param="input") from None

    async def _hold(self, grant: KeyGrant, request_id: str, amount_nano_usd: int) -> HeldRequest | None:
        """The whole bound or nothing (no clamping: an input is embedded whole). None for a free model."""
        if amount_nano_usd == 0:
            return None
        placing = self.ledger.hold_placed(PlaceHold(
            grant.account_id, amount_nano_usd, hold_key(request_id), self.hold_ttl_s,
            spend_limit_id=grant.spend_limit_id, replica_id=self.replica_id))
        try:
            hold = await asyncio.shield(placing)
        except asyncio.CancelledError:  # the caller left: release the hold whenever it lands
            placing.add_done_callback(self.settler.release_when_placed)
            raise
        except Exception as exc:
            refusal = hold_refusal(exc, "send less input")
            if refusal is None:
                raise
            raise refusal from None
        held = HeldRequest(hold.hold_id, request_id)
        self.settler.track(held)  # renewed while the workers answer
        return held

    # The workers
    async def _ask_workers(self, ask: EmbeddingAsk, candidates: list[registry.WorkerView]) -> _Attempted:
        head = ask.inputs[0] if not ask.token_ids else ""
        key = routing.affinity_key(ask.model, {"prompt": head})
        failures: list[str] = []
        malformed = False
        for worker in self.directory.place(ask.model, key, candidates, 0)[:UPSTREAM_ATTEMPTS_MAX]:
            try:
                return _Attempted(worker, await self._ask(worker, ask))
            except Malformed as exc:
                malformed = True
                failures.append(f"worker {worker.id}: {exc}")
            except _Retry as exc:
                failures.append(f"worker {worker.id}: {exc}")
        if malformed:
            raise UpstreamFailed(f"no worker gave a usable answer ({'; '.join(failures)}); nothing was charged")
        raise NoWorkerAvailable(f"every worker tried failed ({'; '.join(failures)}); nothing was charged")

    async def _ask(self, worker: registry.WorkerView, ask: EmbeddingAsk) -> Vectors:
        body = {"model": worker.served_model or worker.model, "input": ask.inputs, "encoding_format": "float"}
        if ask.dimensions:
            body["dimensions"] = ask.dimensions
        load = self.directory.load(worker.id)
        load.in_flight += 1
        response = None
        try:
            response = await self.upstream.post(worker.url + EMBEDDINGS_PATH, orjson.dumps(body))
            raw = await _read_bounded(response)
        except UpstreamError as exc:
            raise _Retry(str(exc)) from None
        finally:
            load.in_flight -= 1
            if response is not None:
                response.close()
        if response.status == 400:
            raise _refusal(raw)
        if response.status != 200:
            raise _Retry(f"answered {response.status}")
        return read_answer(raw, len(ask.inputs), ask.dimensions)

    # Settling
    async def _settle(self, held: HeldRequest, worker: registry.WorkerView, grant: KeyGrant, ask: EmbeddingAsk,
                      billed: Billed, started_at: datetime) -> None:
        """Charge the hold, durably, before the answer is given; a settlement
        that cannot be written withholds the answer (the Settler's rule)."""
        held.finished = True
        if billed.cost_nano_usd == 0:  # the worker counted no token
            await self.settler.release(held)
            self._unbilled(held.request_id, grant, ask, worker.id, unbilled.FAILED, unbilled.EMPTY_COMPLETION)
            return
        meta = {"model": ask.model, "worker_id": worker.id, "api_key_id": grant.id, "prompt_tokens": billed.prompt_tokens,
                "completion_tokens": 0, "started_at": started_at.isoformat()}
        command = cmd.SettleRequest(held.hold_id, worker.owner_account_id, billed.cost_nano_usd, held.request_id,
                                    settlement_key(held.request_id), meta)
        try:
            await self.settler._append(command)
        except Exception as exc:  # withheld; a settlement whose outcome is unknown is reversed once the database is back
            await self.settler._settle_later(held, None, database_away=_database_away(exc))
        finally:
            self.settler._live.pop(held.request_id, None)

    async def _record_discrepancy(self, request_id: str, attempted: _Attempted, grant: KeyGrant, billed: Billed) -> None:
        """A prompt reported above its bound, as chat records it (a strike only across accounts)."""
        discrepancy = cmd.RecordUsageDiscrepancy(
            request_id, attempted.worker.id, attempted.vectors.reported_prompt_tokens, 0, billed.prompt_tokens, 0,
            f"usage-discrepancy:{request_id}", grant.account_id, registry.PROMPT_ABOVE_BOUND)
        try:
            await asyncio.to_thread(self._strike, discrepancy)
        except Exception:  # the charge is settled already; the evidence is what is lost
            log.exception("the usage discrepancy of request %s could not be recorded", request_id)

    def _strike(self, discrepancy: cmd.RecordUsageDiscrepancy) -> None:
        with self.ledger.engine.begin() as conn:
            registry.record_usage_discrepancy(conn, discrepancy, proof=False)


def _answer(ask: EmbeddingAsk, vectors: list[list[float]], billed: Billed) -> dict:
    """OpenAI's CreateEmbeddingResponse, with the cost as chat gives it."""
    cost_text = nano_usd_to_usd_text(billed.cost_nano_usd)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v, ask.base64)} for i, v in enumerate(vectors)],
        "model": ask.model,
        "usage": {"prompt_tokens": billed.prompt_tokens, "total_tokens": billed.prompt_tokens,
                  "cost": orjson.Fragment(cost_text.encode()), "cost_details": {"nano_usd": billed.cost_nano_usd}},
    }


async def _read_bounded(response) -> bytes:
    parts, size_bytes = [], 0
    async for piece in response.pieces():
        size_bytes += len(piece)
        if size_bytes > EMBEDDING_ANSWER_BYTES_MAX:
            raise Malformed(f"the answer is above {EMBEDDING_ANSWER_BYTES_MAX} bytes")
        parts.append(piece)
    return b"".join(parts)


def _refusal(raw: bytes) -> InvalidRequest:
    """A worker's 400 is the caller's problem (an input too long, a dimensions it cannot give)."""
    detail = raw[:UPSTREAM_REFUSAL_DETAIL_BYTES_MAX]
    try:
        parsed = orjson.loads(detail)
        message = parsed.get("message") or parsed["error"]["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = detail.decode(errors="replace")
    if not isinstance(message, str):
        message = str(message)
    if "context" in message.lower() or "too long" in message.lower():
        return ContextTooLong(message, param="input")
    return InvalidRequest(message, param="dimensions" if "dimension" in message.lower() else "input")


def _database_away(exc: BaseException) -> bool:
    return isinstance(exc, DatabaseUnavailable) or is_connection_failure(exc)
