"""The simulated worker speaks vLLM's API: shapes, usage, errors, aborts, pacing.

Every test talks to a real uvicorn server on localhost through the official
`openai` SDK or raw httpx. Timing assertions only bound from the side that
cannot flake (a paced worker is not instant; warm beats cold by a wide margin).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from proxy.sim.profiles import get_profile
from proxy.sim.requests import HttpError
from proxy.sim.worker import SimWorker, build_app

MODEL = "sim-model"
STARTUP_TIMEOUT_S = 10.0
POLL_TIMEOUT_S = 5.0


class RunningWorker:
    def __init__(self, app: SimWorker, base_url: str) -> None:
        self.app = app
        self.base_url = base_url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="sim", max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="sim", max_retries=0)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.base_url}/metrics").text
        samples = re.finditer(r"^(vllm:[a-z_]+)\{[^}]*\} (\S+)$", text, re.MULTILINE)
        return {m[1]: float(m[2]) for m in samples}


@contextlib.contextmanager
def running_worker(app: SimWorker) -> Iterator[RunningWorker]:
    """Serves the app with uvicorn in a background thread on a free port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, http="httptools", loop="uvloop", log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("simulated worker did not start")
        time.sleep(0.01)
    try:
        yield RunningWorker(app, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(STARTUP_TIMEOUT_S)
        sock.close()


@pytest.fixture(scope="module")
def instant() -> Iterator[RunningWorker]:
    with running_worker(build_app("instant", MODEL)) as worker:
        yield worker


@pytest.fixture(scope="module")
def h200_fast() -> Iterator[RunningWorker]:
    """H200 timings, five times faster than life."""
    with running_worker(build_app("h200", MODEL, time_scale=5)) as worker:
        yield worker


@pytest.fixture(scope="module")
def h200_real_time() -> Iterator[RunningWorker]:
    with running_worker(build_app("h200", MODEL, time_scale=1)) as worker:
        yield worker


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def sse_events(response: httpx.Response) -> list[bytes]:
    """Every `data:` payload, [DONE] included, checking the SSE framing."""
    body = response.read()
    frames = body.split(b"\n\n")
    if frames[-1] != b"":
        raise AssertionError(f"stream does not end with a blank line: {body[-40:]!r}")
    events = []
    for frame in frames[:-1]:
        if not frame.startswith(b"data: "):
            raise AssertionError(f"not an SSE data frame: {frame!r}")
        events.append(frame[len(b"data: ") :])
    return events


def raw_chat(worker: RunningWorker, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "messages": user("hi"), **body}
    return httpx.post(f"{worker.base_url}/v1/chat/completions", json=payload, timeout=30)


def wait_until(predicate, timeout_s: float = POLL_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


# --- shapes ------------------------------------------------------------------


def test_chat_stream_with_sdk_sends_role_chunk_one_token_per_chunk_and_final_usage(instant: RunningWorker) -> None:
    chunks = list(
        instant.client().chat.completions.create(
            model=MODEL,
            messages=user("hello world!"),
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    first, tokens, usage_chunk = chunks[0], chunks[1:-1], chunks[-1]
    assert first.object == "chat.completion.chunk"
    assert first.id.startswith("chatcmpl-")
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert len(tokens) == 12
    assert all(re.fullmatch(r" [a-z]+", c.choices[0].delta.content) for c in tokens)
    assert tokens[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in tokens[:-1])
    assert usage_chunk.choices == []
    # "hello world!" is 12 bytes: 12 // 4 + 4 per message.
    assert usage_chunk.usage.prompt_tokens == 7
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.total_tokens == 19


def test_stream_without_stream_options_carries_no_usage_and_ends_with_done(instant: RunningWorker) -> None:
    response = raw_chat(instant, stream=True, max_tokens=5)

    events = sse_events(response)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert len(chunks) == 6  # the role chunk, then one per token
    assert all("usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert re.fullmatch(r"chatcmpl-[0-9a-f]+", chunks[0]["id"])
    assert all(c["model"] == MODEL and isinstance(c["created"], int) for c in chunks)


def test_continuous_usage_puts_cumulative_usage_on_every_chunk(instant: RunningWorker) -> None:
    response = raw_chat(
        instant, stream=True, max_tokens=4, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )

    chunks = [orjson.loads(e) for e in sse_events(response)[:-1]]
    assert all("usage" in c for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 4, 4]
    assert chunks[-1]["choices"] == []
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks
    )


def test_sim_tokens_stops_early_with_stop_and_zero_gives_empty_answer(instant: RunningWorker) -> None:
    client = instant.client()

    short = client.chat.completions.create(
        model=MODEL, messages=user("hi"), max_tokens=10, extra_body={"sim_tokens": 3}
    )
    empty = client.chat.completions.create(
        model=MODEL, messages=user("hi"), max_tokens=10, extra_body={"sim_tokens": 0}
    )

    assert short.object == "chat.completion"
    assert short.choices[0].finish_reason == "stop"
    assert short.choices[0].message.role == "assistant"
    assert short.usage.completion_tokens == 3
    assert len(short.choices[0].message.content.split()) == 3
    assert empty.choices[0].message.content == ""
    assert empty.choices[0].finish_reason == "stop"
    assert empty.usage.completion_tokens == 0


def test_empty_stream_still_finishes_and_reports_usage(instant: RunningWorker) -> None:
    response = raw_chat(instant, stream=True, sim_tokens=0, stream_options={"include_usage": True})

    chunks = [orjson.loads(e) for e in sse_events(response)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_text_is_deterministic(instant: RunningWorker) -> None:
    client = instant.client()

    answers = {
        client.chat.completions.create(model=MODEL, messages=user(str(i)), max_tokens=20).choices[0].message.content
        for i in range(3)
    }

    assert len(answers) == 1


def test_async_sdk_completions_stream_and_not(instant: RunningWorker) -> None:
    async def scenario() -> tuple[list, object]:
        client = instant.async_client()
        stream = await client.completions.create(
            model=MODEL,
            prompt=["once upon a time", "ignored"],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        whole = await client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=6)
        await client.close()
        return chunks, whole

    chunks, whole = asyncio.run(scenario())

    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 6
    assert all(c.object == "text_completion" and c.id.startswith("cmpl-") for c in chunks)
    assert chunks[-1].usage.completion_tokens == 6
    assert whole.object == "text_completion"
    assert whole.choices[0].text == "".join(texts)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len("once upon a time") // 4 + 4


def test_max_completion_tokens_wins_for_chat(instant: RunningWorker) -> None:
    answer = instant.client().chat.completions.create(model=MODEL, messages=user("hi"), max_completion_tokens=3)

    assert answer.usage.completion_tokens == 3


def test_models_health_and_metrics_endpoints(instant: RunningWorker) -> None:
    models = httpx.get(f"{instant.base_url}/v1/models").json()
    health = httpx.get(f"{instant.base_url}/health")
    metrics = httpx.get(f"{instant.base_url}/metrics").text

    assert models["object"] == "list"
    card = models["data"][0]
    assert card == {
        **card,
        "id": MODEL,
        "object": "model",
        "owned_by": "vllm",
        "root": MODEL,
        "parent": None,
        "max_model_len": 32768,
        "permission": [],
    }
    assert [m.id for m in instant.client().models.list()] == [MODEL]
    assert health.status_code == 200 and health.content == b""
    families = {family.name: family for family in text_string_to_metric_families(metrics)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert families[f"vllm:{name}"].type == "gauge"
        assert [(s.name, s.labels) for s in families[f"vllm:{name}"].samples] == [(f"vllm:{name}", {"model_name": MODEL})]
    for name in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens"):
        assert families[f"vllm:{name}"].type == "counter"
        assert f'vllm:{name}_total{{model_name="{MODEL}"}}' in metrics


def test_max_model_len_is_overridable() -> None:
    app = build_app("h200", MODEL, max_model_len=100)

    with pytest.raises(HttpError) as error:
        app.parse_request(orjson.dumps({"messages": user("x" * 40), "max_tokens": 90}), chat=True)

    assert error.value.status == 400
    assert "maximum context length is 100 tokens" in error.value.message


# --- errors --------------------------------------------------------------------


def test_context_too_long_is_vllms_400(instant: RunningWorker) -> None:
    response = raw_chat(instant, messages=user("hello world!"), max_tokens=40_000)

    assert response.status_code == 400
    assert response.json() == {
        "object": "error",
        "message": "This model's maximum context length is 32768 tokens. However, you requested 40007 tokens "
        "(7 in the messages, 40000 in the completion). Please reduce the length of the messages or completion.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    with pytest.raises(openai.BadRequestError):
        instant.client().chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=40_000)


def test_unknown_model_is_vllms_404(instant: RunningWorker) -> None:
    response = raw_chat(instant, model="nope")

    assert response.status_code == 404
    assert response.json() == {
        "object": "error",
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


def test_fail_before_first_token_is_a_500_with_an_error_body(instant: RunningWorker) -> None:
    started = instant.app.state.requests_started

    response = raw_chat(instant, stream=True, sim_fail_before_first_token=True)

    assert response.status_code == 500
    assert response.json()["type"] == "InternalServerError"
    assert instant.app.state.requests_started == started
    with pytest.raises(openai.InternalServerError):
        instant.client().chat.completions.create(
            model=MODEL, messages=user("hi"), extra_body={"sim_fail_before_first_token": True}
        )


def test_fail_after_tokens_drops_the_connection_without_done(instant: RunningWorker) -> None:
    failed = instant.app.state.requests_failed
    payload = {"model": MODEL, "messages": user("hi"), "stream": True, "max_tokens": 10, "sim_fail_after_tokens": 3}
    received = b""

    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", f"{instant.base_url}/v1/chat/completions", json=payload) as response,
    ):
        for part in response.iter_bytes():
            received += part

    assert received.count(b'"content":" ') == 3
    assert b"[DONE]" not in received
    wait_until(lambda: instant.app.state.requests_failed == failed + 1)
    assert instant.app.state.requests_running == 0


def test_inflated_usage_per_request_and_per_worker(instant: RunningWorker) -> None:
    client = instant.client()
    honest = client.chat.completions.create(model=MODEL, messages=user("hello world!"), max_tokens=5)
    inflated = client.chat.completions.create(
        model=MODEL, messages=user("hello world!"), max_tokens=5, extra_body={"sim_inflate_usage": 3}
    )

    assert (inflated.usage.prompt_tokens, inflated.usage.completion_tokens) == (3 * honest.usage.prompt_tokens, 15)
    assert inflated.usage.total_tokens == 3 * honest.usage.total_tokens
    with running_worker(build_app("instant", MODEL, inflate_usage=2)) as dishonest:
        chunks = list(
            dishonest.client().chat.completions.create(
                model=MODEL,
                messages=user("hello world!"),
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == 2 * honest.usage.prompt_tokens


def test_bad_requests_are_400(instant: RunningWorker) -> None:
    not_json = httpx.post(f"{instant.base_url}/v1/chat/completions", content=b"{")
    no_messages = raw_chat(instant, messages=[])
    options_without_stream = raw_chat(instant, stream_options={"include_usage": True})

    assert [r.status_code for r in (not_json, no_messages, options_without_stream)] == [400, 400, 400]
    assert httpx.get(f"{instant.base_url}/v1/nothing").status_code == 404
    assert httpx.get(f"{instant.base_url}/v1/chat/completions").status_code == 405


# --- load, aborts, pacing -------------------------------------------------------


def test_disconnect_aborts_generation_and_metrics_follow(h200_real_time: RunningWorker) -> None:
    worker = h200_real_time
    state = worker.app.state
    aborted, generated = state.requests_aborted, state.generation_tokens_total
    payload = {"model": MODEL, "messages": user("tell me a long story"), "stream": True, "max_tokens": 5_000}

    with httpx.stream("POST", f"{worker.base_url}/v1/chat/completions", json=payload) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        during = worker.metrics()
    # Leaving the block closed the connection after about 3 of 5,000 tokens (~30 s of decoding).

    assert during["vllm:num_requests_running"] == 1
    assert 0 < during["vllm:kv_cache_usage_perc"] <= 1
    wait_until(lambda: state.requests_aborted == aborted + 1)
    assert state.requests_running == 0
    assert state.generation_tokens_total - generated < 5_000
    after = worker.metrics()
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:generation_tokens_total"] > during["vllm:generation_tokens_total"] - 1


def test_paced_worker_is_not_instant(h200_fast: RunningWorker) -> None:
    profile = get_profile("h200")
    tokens = 20
    expected_s = tokens / profile.single_request_tok_s / h200_fast.app.time_scale

    started = time.monotonic()
    chunks = list(
        h200_fast.client().chat.completions.create(
            model=MODEL, messages=user(uuid.uuid4().hex), max_tokens=tokens, stream=True
        )
    )
    elapsed_s = time.monotonic() - started

    assert len(chunks) == tokens + 1
    assert elapsed_s >= 0.5 * expected_s


def streamed_text(worker: RunningWorker, messages: list[dict[str, str]]) -> str:
    payload = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": 8}
    text = ""
    with httpx.stream("POST", f"{worker.base_url}/v1/chat/completions", json=payload, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += orjson.loads(line[len("data: ") :])["choices"][0]["delta"].get("content") or ""
    return text


def test_follow_up_on_the_worker_holding_its_prefix_starts_much_sooner(h200_fast: RunningWorker) -> None:
    # The engine's scheduled prefill, not a wall clock, is compared: the machine's load cannot move it.
    state = h200_fast.app.state
    history = user(uuid.uuid4().hex + " context " * 3_200)  # about 8,000 tokens, never seen before
    prefill_before = state.prefill_seconds_total
    answer = streamed_text(h200_fast, history)
    cold_prefill_s = state.prefill_seconds_total - prefill_before
    hits_before = state.prefix_cache_hits_tokens

    follow_up = [*history, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    streamed_text(h200_fast, follow_up)
    warm_prefill_s = state.prefill_seconds_total - prefill_before - cold_prefill_s

    assert answer
    assert 0 < warm_prefill_s < cold_prefill_s / 2
    assert state.prefix_cache_hits_tokens - hits_before > 7_000
    metrics = h200_fast.metrics()
    assert metrics["vllm:prefix_cache_hits_total"] <= metrics["vllm:prefix_cache_queries_total"]
