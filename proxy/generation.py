"""One request's stream: what the caller sees of the worker's chunks, and the
counts settlement needs.

The proxy (proxy/service.py) plans a `Generation`, places its hold, and opens
an upstream attempt on it; `relay_to(writer)` relays the rest and, once the
stream ends, hands the generation to the settle callback it was built with
(proxy/settlement.py). It knows nothing of either module.

The worker's stream is read in its socket's read callback (`take_piece`,
through `UpstreamResponse.pour`): each piece is parsed, counted and written
to the caller there, with no task woken per token; the relay's task wakes
only when reading is over or the caller is behind."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from datetime import datetime

import orjson

from ledger.hold_pool import Reservation
from ledger.money import nano_usd_to_usd_text
from proxy import answer, metering, sse
from proxy import workers as registry
from proxy.errors import NotReady, ProxyError, UpstreamFailed
from proxy.keys import KeyGrant
from ledger.limits import MS_PER_S
from proxy.limits import TOOL_CALLS_PER_ANSWER_MAX
from proxy.metering import utf8_bytes
from proxy.prices import Price
from proxy.upstream import UpstreamError, UpstreamResponse

CHAT, COMPLETIONS = "chat", "completions"
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
# How a stream ended, as its settlement records it (meta "outcome"): it ran to
# its end; it was cut short (the caller left, or the sweeper took its hold);
# the worker failed after the first token.
COMPLETED, CANCELLED, FAILED_MID_STREAM = "completed", "cancelled", "failed_mid_stream"
# Settles an ended generation once, in a task nothing the caller does can
# cancel: `charge=True` bills what was delivered; `charge=False` (nothing was
# delivered) releases its hold.
Settle = Callable[["Generation", bool], asyncio.Future]


class EventWriter(Protocol):
    """Where a generation writes the caller's chunks (app/http/chunk_writers.py)."""

    def write(self, chunks: list[bytes]) -> None:
        """Send these chunks, in order; called from the worker's read callback, so it must not block or raise."""

    @property
    def backed_up(self) -> bool:
        """The caller is behind: read no more until `drain`."""

    @property
    def gone(self) -> bool:
        """The caller left: nothing written reaches it any more."""

    async def drain(self) -> None:
        """Wait until the caller can take more (and send what is waiting)."""


class Collector:
    """An answer assembled in the proxy, not streamed: each chunk to `add`."""

    backed_up = gone = False

    def __init__(self, add: Callable[[bytes], None]) -> None:
        self.add = add

    def write(self, chunks: list[bytes]) -> None:
        for chunk in chunks:
            self.add(chunk)

    async def drain(self) -> None:
        return None


@dataclass(eq=False)
class Generation:
    # The request, as planned before its hold
    kind: str
    request_id: str
    model: str
    price: Price
    grant: KeyGrant
    prompt_bound: int  # the byte bound: what is billed at most
    max_tokens: int  # lowered to what the hold pays for (accept_hold)
    wants_usage: bool
    wants_continuous_usage: bool
    started_at: datetime
    streaming: bool  # the caller receives tokens as they come (what it has received is delivered)
    settle: Settle
    # The context the prompt takes where the proxy routes it, and what its hold is sized for:
    # a count plus its margin for a long prompt, 0 for prompt_bound.
    context_bound: int = 0
    choices_per_prompt: int = 1  # n: choice index = prompt_index * n + j
    choices: int = 1  # n times the prompts: every choice may use all of max_tokens
    started_s: float = field(default_factory=time.perf_counter)  # the request's start, for its time to first token
    # Its hold (accept_hold)
    hold_id: int = field(default=0, init=False)
    hold_nano_usd: int = field(default=0, init=False)
    # Its share of this replica's pooled hold (PARALON_HOLD_POOLS) until it settles, releases, or moves to a hold of its own.
    reservation: Reservation | None = field(default=None, init=False)
    split_pending: bool = field(default=False, init=False)  # its move to a hold of its own may or may not have happened
    capture_unknown: bool = field(default=False, init=False)  # its capture from the pool was sent, its outcome not known
    hold_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)  # one use of its hold at a time
    # The upstream attempt (use_worker, attach, read_to_first_token; forget_attempt undoes them)
    worker: registry.WorkerView | None = field(default=None, init=False)
    upstream_body: dict | None = field(default=None, init=False)
    tool_names: frozenset[str] = field(default=frozenset(), init=False)  # the functions the request offered
    response: UpstreamResponse | None = field(default=None, init=False)
    reader: sse.DataReader = field(default_factory=sse.DataReader, init=False)  # the upstream stream's events
    pending: list[bytes] = field(default_factory=list, init=False)  # chunks read before the first token
    writer: EventWriter | None = field(default=None, init=False)  # where chunks go once the caller's stream started
    reading_over: bool = field(default=False, init=False)  # [DONE], an overrun or a lost hold: read no more
    relay_error: Exception | None = field(default=None, init=False)  # the worker's stream broke: a bad event
    first_token_at: float = field(default=0.0, init=False)
    upstream_done: bool = field(default=False, init=False)  # [DONE] came before any token: an empty completion
    # What the caller received, and what the worker reported
    output: metering.ChoiceOutputs = field(init=False)
    reported_prompt: int | None = field(default=None, init=False)
    reported_completion: int | None = field(default=None, init=False)
    # vLLM's continuous usage is per choice (its prompt, its tokens so far); the last usage chunk is the total
    _reported_by_choice: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _reported_by_prompt: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _reported_total: bool = field(default=False, init=False, repr=False)
    overran: bool = field(default=False, init=False)  # the worker sent more tokens than the hold pays for
    relayed_booked: int = field(default=0, init=False)  # of counted_tokens, booked as its worker's delivery
    created: int = field(default=0, init=False)
    # Settlement (proxy/settlement.py reports through the methods below)
    hold_lost: bool = field(default=False, init=False)  # the sweeper closed the hold while this ran
    recorded_capture_nano_usd: int = field(default=0, init=False)  # the delivered usage last recorded against the hold
    finished: bool = field(default=False, init=False)
    settle_failed: bool = field(default=False, init=False)  # a non-streaming answer whose charge could not be written
    # Until the stream ends otherwise, a settlement (the sweeper's, at the usage recorded) is of a stream cut short.
    outcome: str = field(default=CANCELLED, init=False)
    cost_nano_usd: int = field(default=0, init=False)
    usage: dict = field(default_factory=dict, init=False)
    _settling: asyncio.Future | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.output = metering.ChoiceOutputs.of(self.choices)

    # Before the first token
    def accept_hold(self, hold_id: int, amount_nano_usd: int) -> None:
        """The hold granted, perhaps less than planned: max_tokens falls to what it pays for."""
        self.hold_id, self.hold_nano_usd = hold_id, amount_nano_usd
        affordable = metering.affordable_max_tokens(self.price, self.context_bound or self.prompt_bound, amount_nano_usd,
                                                    self.choices)
        self.max_tokens = min(self.max_tokens, affordable)

    def use_worker(self, worker: registry.WorkerView | None, upstream_body: dict) -> None:
        """The attempt about to start, and what the proxy counts of its body once
        rather than per chunk: the functions offered, the stop strings asked for."""
        self.worker, self.upstream_body = worker, upstream_body
        self.tool_names = metering.offered_tool_names(upstream_body)
        for choice in self.output.choices:
            choice.stop_bytes = metering.stop_bytes_max(upstream_body)

    def upstream_url(self) -> str:
        return self.worker.url + PATHS[self.kind]

    def attach(self, response: UpstreamResponse) -> None:
        self.response = response

    async def read_to_first_token(self) -> bool:
        """Read the attached response up to its first token (kept for the
        caller, with the rest of the piece it came in) or an early [DONE];
        False when the stream ended before either."""
        await self.response.pour(self.take_piece)
        if self.relay_error is not None:
            raise self.relay_error
        return bool(self.counted_tokens) or self.reading_over

    def forget_attempt(self) -> registry.WorkerView | None:
        """A failed attempt before the first token: the next worker starts from
        nothing. Returns the worker it had, whose load the proxy counted."""
        worker = self.worker
        self.worker, self.response, self.reader = None, None, sse.DataReader()
        self.pending, self.reading_over, self.relay_error = [], False, None
        self.output = metering.ChoiceOutputs.of(self.choices, self.output.choices[0].stop_bytes)
        self.reported_prompt = self.reported_completion = None
        self._reported_by_choice, self._reported_by_prompt, self._reported_total = {}, {}, False
        self.first_token_at, self.upstream_done = 0.0, False
        return worker

    # The relay
    def take_piece(self, piece: bytes) -> bool:
        """One piece of the worker's stream, in its socket's read callback: its
        chunks go to the caller's writer (before the first token, to pending).
        False once the relay must look up: reading is over, the writer is
        backed up, or (before the writer) the first token is here."""
        if self.writer is not None and self.writer.gone:  # its relay is being cancelled: what comes is neither
            return False  # delivered nor counted
        chunks = self.pending if self.writer is None else []
        try:
            for data in self.reader.feed(piece):
                if data == sse.DONE:
                    self.end_of_stream()
                    break
                out = self.transform(data)
                if out is not None:
                    chunks.append(out)
                if self.upstream_done or self.overran or self.hold_lost:
                    self.reading_over = True  # stop the worker; what it produced is billed
                    break
        except (UpstreamFailed, ValueError) as exc:
            self.relay_error, self.reading_over = exc, True
        if self.writer is None:
            return not (self.reading_over or self.counted_tokens)
        if chunks:
            self.writer.write(chunks)
        return not (self.reading_over or self.writer.backed_up)

    def end_of_stream(self) -> None:
        """The worker's [DONE]: the answer ended (with or without a finish_reason)."""
        self.reading_over = True
        if self.counted_tokens:
            self.output.finish_all()
        else:
            self.upstream_done = True

    def transform(self, data: bytes) -> bytes | None:
        """One upstream event to what the caller sees; None to hide it."""
        chunk = orjson.loads(data)
        if type(chunk) is not dict:
            raise UpstreamFailed("the worker sent an event that is not a JSON object")
        if "error" in chunk and "choices" not in chunk:
            raise UpstreamFailed(f"the worker failed: {chunk['error']}")
        usage = chunk.pop("usage", None)
        choices = chunk.get("choices")
        if not choices:
            if usage:
                self._note_usage(usage, None)
            return None  # the final usage chunk: the caller gets ours, with the cost, after settling
        kept = self._kept_choices(chunk, choices)
        if usage and kept:
            self._note_usage(usage, _index_of(kept[0]))
        relayed = [choice for choice in kept if self._relay_choice(choice)]
        if not relayed:
            return None
        if len(relayed) != len(choices):
            chunk["choices"] = relayed
        chunk["id"], chunk["model"] = self.request_id, self.model
        self.created = chunk.get("created") or self.created
        if usage and self.wants_continuous_usage:
            chunk["usage"] = usage
        return sse.encode(chunk)

    def _relay_choice(self, choice: dict) -> bool:
        """Count one choice's output against its own max_tokens; False to hide it."""
        output = self.output.choices[_index_of(choice)]
        relayed_bytes = self._output_bytes(choice, output)
        if relayed_bytes:
            if output.relayed_chunks >= self.max_tokens:  # never relay a token nobody pays for
                self.overran = True
                return False
            output.relayed_chunks += 1
            output.relayed_bytes += relayed_bytes
            if not self.first_token_at:
                self.first_token_at = time.perf_counter()
        if choice.get("finish_reason"):
            output.finished = True
        logprobs = choice.get("logprobs")
        if self.kind == CHAT and logprobs:  # vLLM omits what OpenAI's chunk schema requires
            logprobs.setdefault("content", None)
            logprobs.setdefault("refusal", None)
        return True

    @property
    def counted_tokens(self) -> int:
        """Chunks relayed with output, each at least one token, over all
        choices: max_tokens is enforced on each choice's count, so that nothing
        is relayed that the hold does not pay for."""
        return self.output.relayed_chunks

    def _note_usage(self, usage: object, index: int | None) -> None:
        """The worker's report: the total (a usage chunk without choices), or
        one choice's running count (its prompt's tokens, its own tokens so far)."""
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if index is None:
            self._reported_total = True
            if type(prompt) is int and prompt >= 0:
                self.reported_prompt = prompt
            if type(completion) is int and completion >= 0:
                self.reported_completion = completion
            return
        if self._reported_total:
            return
        if type(prompt) is int and prompt >= 0:
            self._reported_by_prompt[index // self.choices_per_prompt] = prompt
            self.reported_prompt = sum(self._reported_by_prompt.values())
        if type(completion) is int and completion >= 0:
            self._reported_by_choice[index] = completion
            self.reported_completion = sum(self._reported_by_choice.values())

    def _kept_choices(self, chunk: dict, choices: object) -> list[dict]:
        """The choices the caller may get, each index at most once per chunk;
        malformed, out-of-range and duplicate choices are dropped from the
        chunk and counted against the worker."""
        if type(choices) is not list:
            self.output.dropped_choices += 1
            chunk["choices"] = []
            return []
        kept, seen = [], set()
        for choice in choices:
            if _well_formed(self.kind, choice, self.choices) and _index_of(choice) not in seen:
                seen.add(_index_of(choice))
                kept.append(choice)
            else:
                self.output.dropped_choices += 1
        if len(kept) != len(choices):
            chunk["choices"] = kept
        return kept

    def _output_bytes(self, choice: dict, output: metering.OutputCount) -> int:
        """UTF-8 bytes of output in one choice, as the caller receives them.
        Logprobs repeat the text's tokens: they are not output."""
        if self.kind != CHAT:
            return utf8_bytes(choice.get("text"))
        delta = choice.get("delta")
        if not delta:
            return 0
        total = utf8_bytes(delta.get("content")) + utf8_bytes(delta.get("refusal"))
        reasoning_content, reasoning = delta.get("reasoning_content"), delta.get("reasoning")
        total += utf8_bytes(reasoning_content)
        if reasoning != reasoning_content:  # vLLM sends the same text under both names
            total += utf8_bytes(reasoning)
        if delta.get("tool_calls") is not None:
            total += self._tool_call_bytes(delta, output)
        return total

    def _tool_call_bytes(self, delta: dict, output: metering.OutputCount) -> int:
        """Names and arguments relayed. Entries that are not objects, that skip
        an index or open more than TOOL_CALLS_PER_ANSWER_MAX calls are dropped."""
        tool_calls = delta["tool_calls"]
        if type(tool_calls) is not list:
            output.dropped += 1
            del delta["tool_calls"]
            return 0
        kept, total = [], 0
        for call in tool_calls:
            index = call.get("index", 0) if isinstance(call, dict) else None
            if not _opens_or_continues(output, index):
                output.dropped += 1
                continue
            kept.append(call)
            function = call.get("function")
            if isinstance(function, dict):
                name = function.get("name")
                total += utf8_bytes(name) + utf8_bytes(function.get("arguments"))
                if type(name) is str and name in self.tool_names:  # a name not offered is relayed, without the allowance
                    output.tool_call_indexes.add(index)
        if len(kept) != len(tool_calls):
            delta["tool_calls"] = kept
        return total

    def delivered_usage(self) -> metering.BilledUsage:
        """What is billable of what has been relayed so far: the worker's latest
        report where the proxy's own count vouches for it (metering.billable_usage),
        never more completion tokens than the hold pays for, per choice."""
        self.output.max_tokens_per_choice = self.max_tokens
        billed = metering.billable_usage(self.reported_prompt, self.reported_completion,
                                         prompt_bound=self.prompt_bound, output=self.output)
        return billed._replace(completion_tokens=min(billed.completion_tokens, self.max_tokens * self.choices))

    # The caller's stream
    async def relay_to(self, writer: EventWriter) -> None:
        """The caller's stream, written to `writer`: what was read before the
        first token, the rest as it comes (straight from the worker's socket),
        then (after the settlement is durable) the closing chunks."""
        try:
            self.writer = writer
            if self.pending:
                writer.write(self.pending)
                self.pending = []
            while not self.reading_over:
                if writer.backed_up:
                    await writer.drain()
                ended = await self.response.pour(self.take_piece)
                if ended and not self.reading_over:
                    raise UpstreamFailed(self.ENDED_EARLY)
            if self.relay_error is not None:
                raise self.relay_error
            # Its own task: a caller leaving now cannot interrupt the settlement.
            await asyncio.shield(self.settle_once(outcome=self.ended()))
            writer.write(await self.closing_chunks())
        except (UpstreamError, UpstreamFailed, ValueError) as exc:
            # The worker failed mid-stream: a streaming caller keeps what it received and pays for it.
            await asyncio.shield(self.settle_once(charge=self.streaming, outcome=FAILED_MID_STREAM))
            error = exc if isinstance(exc, ProxyError) else UpstreamFailed(f"the worker failed mid-stream: {type(exc).__name__}")
            writer.write([self.error_chunk(error)])
        finally:
            self.settle_once()  # the caller went away: bill what was produced (a no-op once settling)
            await self.close_upstream()
        if writer.backed_up:
            await writer.drain()

    ENDED_EARLY = "the worker's stream ended without [DONE]"

    async def closing_chunks(self) -> list[bytes]:
        """After the settlement: the usage chunk when asked for, and [DONE]."""
        if self.wants_usage:
            return [sse.encode(self.usage_chunk()), sse.DONE_EVENT]
        return [sse.DONE_EVENT]

    def error_chunk(self, error: ProxyError) -> bytes:
        return sse.encode({"error": {"message": str(error), "type": error.error_type, "code": error.code, "param": None}})

    def settle_once(self, *, charge: bool = True, outcome: str = CANCELLED) -> asyncio.Future:
        """The settlement, started on the first call; later calls get the same
        one. Without an outcome the stream did not reach its end: the caller left."""
        if self._settling is None:
            self.outcome = outcome
            self._settling = self.settle(self, charge)
        return self._settling

    def ended(self) -> str:
        """The outcome of a stream that stopped without an error: cut short
        when the sweeper took its hold; otherwise complete (a worker running
        past max_tokens is stopped where the caller's answer ends)."""
        return CANCELLED if self.hold_lost else COMPLETED

    @property
    def ttft_ms(self) -> int | None:
        """Milliseconds from the request's start to its first relayed token; None before one."""
        if not self.first_token_at:
            return None
        return max(0, round((self.first_token_at - self.started_s) * MS_PER_S))

    async def close_upstream(self) -> None:
        """Back to the pool when the response ended cleanly; otherwise the
        connection is closed, which stops the worker."""
        if self.response is not None:
            self.response.close()

    async def collect(self) -> dict:
        """A non-streaming answer, assembled from the same stream."""
        parts = answer.AnswerParts(chat=self.kind == CHAT, choices=self.choices)
        await self.relay_to(Collector(parts.add))
        if self.settle_failed:
            raise NotReady("the answer could not be billed just now, so it is withheld; nothing was charged: try again")
        if parts.error is not None:
            raise UpstreamFailed(parts.error["message"])
        return parts.assembled(self.request_id, self.created or int(time.time()), self.model, self.usage_dict())

    # What settlement reports back
    def begin_settling(self) -> bool:
        """False when it was settled (or released) already."""
        if self.finished:
            return False
        self.finished = True
        return True

    def bill(self, billed: metering.BilledUsage) -> None:
        """The usage billed, and its charge at the request's price."""
        self.usage = {"prompt_tokens": billed.prompt_tokens, "completion_tokens": billed.completion_tokens,
                      "total_tokens": billed.prompt_tokens + billed.completion_tokens}
        # An empty completion costs nothing.
        self.cost_nano_usd = (self.price.charge_nano_usd(billed.prompt_tokens, billed.completion_tokens)
                              if billed.completion_tokens else 0)

    def charged(self, cost_nano_usd: int) -> None:
        """What the ledger actually charged, when it differs from the bill."""
        self.cost_nano_usd = cost_nano_usd

    def withhold(self) -> None:
        """A non-streaming answer that could not be billed: nothing is charged, nothing given."""
        self.cost_nano_usd, self.settle_failed = 0, True

    def lose_hold(self) -> None:
        """The sweeper closed the hold: the stream stops, the rest is charged at the end."""
        self.hold_lost = True

    def note_prompt_tokens(self, prompt_tokens: int) -> None:
        self.reported_prompt = prompt_tokens

    def record_capture(self, capture_nano_usd: int) -> bool:
        """The delivered usage recorded against the hold; False when it has not changed."""
        if capture_nano_usd == self.recorded_capture_nano_usd:
            return False
        self.recorded_capture_nano_usd = capture_nano_usd
        return True

    def usage_dict(self) -> dict:
        """usage.cost is a JSON number written with its nine decimals (no float
        is involved); the exact integer is in cost_details."""
        return {**self.usage, "cost": orjson.Fragment(nano_usd_to_usd_text(self.cost_nano_usd)),
                "cost_details": {"nano_usd": self.cost_nano_usd}}

    def usage_chunk(self) -> dict:
        object_name = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage_dict()}


def _well_formed(kind: str, choice: object, choices: int) -> bool:
    """A choice the caller may get: an object whose index is one of the
    request's (absent means 0), its delta an object, its texts strings."""
    if type(choice) is not dict:
        return False
    index = choice.get("index", 0)
    if type(index) is not int or not 0 <= index < choices:
        return False
    logprobs = choice.get("logprobs")
    if logprobs is not None and type(logprobs) is not dict:
        return False
    if kind != CHAT:
        return _text_or_none(choice.get("text"))
    delta = choice.get("delta") or {}
    return (type(delta) is dict and _text_or_none(delta.get("content")) and _text_or_none(delta.get("refusal"))
            and _text_or_none(delta.get("reasoning_content")) and _text_or_none(delta.get("reasoning")))


def _index_of(choice: dict) -> int:
    return choice.get("index", 0)


def _opens_or_continues(output: metering.OutputCount, index: object) -> bool:
    """A call already open, or the next one: engines number calls 0, 1, 2, ..."""
    if type(index) is not int or not 0 <= index <= output.tool_calls_opened:
        return False
    if index < output.tool_calls_opened:
        return True
    if output.tool_calls_opened >= TOOL_CALLS_PER_ANSWER_MAX:
        return False
    output.tool_calls_opened += 1
    return True


def _text_or_none(value: object) -> bool:
    return value is None or type(value) is str
