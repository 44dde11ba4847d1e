"""What llama-cpp-python's OpenAI-compatible server really sends, on a tiny random model.

Each test pins down one behaviour the proxy must cope with, most of them unlike vLLM's:
no usage in streams whatever ``stream_options`` says, no /health or /metrics, the
requested model name echoed back unchecked, a too-long prompt breaking a stream after a
200, and ``max_tokens`` quietly shortened to fit the context.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed")
pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed")

from tests.support.llamacpp_server import running_llamacpp_server  # noqa: E402
from tests.support.tiny_gguf import write_tiny_model  # noqa: E402

ALIAS = "tiny-llama"
N_CTX = 512
HELLO = [{"role": "user", "content": "Say hello"}]
# Each "hello " is several tokens in the tiny vocabulary: 600 of them overflow 512.
TOO_LONG = [{"role": "user", "content": "hello " * 600}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf")


@pytest.fixture(scope="module")
def base_url(model_path):
    with running_llamacpp_server(model_path, ALIAS, n_ctx=N_CTX) as url:
        yield url


@pytest.fixture
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        yield http


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"model": ALIAS, "messages": HELLO, "max_tokens": 8, **fields})


def read_sse(lines: Iterator[str]) -> tuple[list[dict], bool, bool]:
    """Returns the JSON events, whether ``[DONE]`` came, and whether the body was cut off."""
    events, done = [], False
    try:
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    except httpx.RemoteProtocolError:
        return events, done, True
    return events, done, False


def stream_chat(client, **fields) -> tuple[list[dict], bool, bool]:
    body = {"model": ALIAS, "messages": HELLO, "max_tokens": 8, "stream": True, **fields}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        return read_sse(response.iter_lines())


def test_tiny_model_is_small_and_deterministic(tmp_path):
    first = write_tiny_model(tmp_path / "a.gguf", seed=0).read_bytes()
    assert first == write_tiny_model(tmp_path / "b.gguf", seed=0).read_bytes()
    assert first != write_tiny_model(tmp_path / "c.gguf", seed=1).read_bytes()
    assert len(first) < 5_000_000


def test_models_lists_the_alias_only(client):
    assert client.get("/v1/models").json() == {
        "object": "list",
        "data": [{"id": ALIAS, "object": "model", "owned_by": "me", "permissions": []}],
    }


def test_chat_completion_reports_usage(client):
    response = chat(client)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == ALIAS
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_model_field_echoes_the_request_unchecked(client, model_path):
    unknown = chat(client, model="no-such-model")
    assert unknown.status_code == 200
    assert unknown.json()["model"] == "no-such-model"
    unnamed = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8})
    assert unnamed.json()["model"] == str(model_path)


def test_n_above_one_is_ignored(client):
    assert len(chat(client, n=2).json()["choices"]) == 1


def test_stop_sequence_ends_with_finish_reason_stop(client):
    text = chat(client, temperature=0).json()["choices"][0]["message"]["content"]
    stop = text[3]
    stopped = chat(client, temperature=0, stop=[stop]).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert stopped["usage"]["completion_tokens"] < 8


def test_stream_ignores_stream_options_and_never_sends_usage(client):
    events, done, cut_off = stream_chat(
        client, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert done and not cut_off
    assert all("usage" not in event and len(event["choices"]) == 1 for event in events)
    assert all(event["object"] == "chat.completion.chunk" and event["model"] == ALIAS for event in events)
    assert len({event["id"] for event in events}) == 1

    first, *content, last = events
    assert first["choices"][0]["delta"] == {"role": "assistant"}
    assert first["choices"][0]["finish_reason"] is None
    assert len(content) == 8
    assert all(set(event["choices"][0]["delta"]) == {"content"} for event in content)
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == "length"


def test_prompt_over_context_is_a_400_in_openai_error_shape(client):
    response = client.post("/v1/chat/completions", json={"model": ALIAS, "messages": TOO_LONG, "max_tokens": 8})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert error["message"].startswith(f"This model's maximum context length is {N_CTX} tokens.")


def test_prompt_over_context_breaks_a_stream_after_a_200(client):
    events, done, _ = stream_chat(client, messages=TOO_LONG)
    assert events == [] and not done


def test_max_tokens_is_shortened_to_fit_the_context(client):
    response = chat(client, messages=[{"role": "user", "content": "hello " * 80}], max_tokens=400)
    assert response.status_code == 200
    body = response.json()
    assert body["usage"]["total_tokens"] == N_CTX
    assert body["usage"]["completion_tokens"] < 400
    assert body["choices"][0]["finish_reason"] == "length"


def test_malformed_request_is_a_500(client):
    response = client.post("/v1/chat/completions", json={"model": ALIAS, "messages": "not a list"})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "internal_server_error"


def test_no_health_or_metrics_endpoints(client):
    assert client.get("/health").status_code == 404
    assert client.get("/metrics").status_code == 404


def test_server_default_lets_any_request_cut_a_running_stream(model_path):
    # A long context makes the stream outlast the interrupting request by seconds.
    with running_llamacpp_server(model_path, ALIAS, n_ctx=4096, interrupt_requests=True) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            body = {"model": ALIAS, "messages": HELLO, "max_tokens": 3000, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                # In a thread: the stream only notices the waiting request as this one reads on.
                models = threading.Thread(target=lambda: httpx.get(f"{url}/v1/models", timeout=60))
                models.start()
                events, done, cut_off = read_sse(lines)
                models.join()
    assert done and cut_off
    assert len(events) < 3000
    assert all(event["choices"][0]["finish_reason"] is None for event in events)
