"""A real engine: llama.cpp (llama-cpp-python's server) on a tiny model the
test generates, beside a simulated vLLM worker under one public model name."""
from __future__ import annotations

import os

import httpx
import openai
import pytest

from ledger.verify import verify
from proxy.generations import generation_record
from tests.support.harness import MODEL, make_fleet, serving, sim_worker
from tests.support.llamacpp_server import running_llamacpp_server
from tests.support.tiny_gguf import write_tiny_model

if os.environ.get("PARALON_REQUIRE_SERVICES") != "1":  # CI must run it, never skip it
    pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is installed by `make venv`")

LLAMACPP_CONTEXT_TOKENS = 512


@pytest.fixture
def mixed_fleet(sqlite_url, tmp_path):
    model_path = write_tiny_model(tmp_path / "tiny.gguf")
    vllm = sim_worker("instant")
    with running_llamacpp_server(model_path, "tiny-llama", n_ctx=LLAMACPP_CONTEXT_TOKENS) as llama_url:
        fleet = make_fleet(sqlite_url, [vllm.url, llama_url], engines=["vllm", "llamacpp"],
                           context_lengths=[None, LLAMACPP_CONTEXT_TOKENS])
        with serving(sqlite_url) as proxy:
            yield fleet, proxy, llama_url
    vllm.stop()


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path}/paralon.db"


def _served_by(proxy, fleet, request_id):
    """The customer's view of the charge, and which worker served it (the settlement's, not shown to customers)."""
    shown = httpx.get(f"{proxy.url}/v1/generations/{request_id}", headers={"authorization": f"Bearer {fleet.key}"}).json()
    with fleet.engine.connect() as conn:
        return {**shown, "worker_id": generation_record(conn, request_id)["worker_id"]}


def test_both_engines_answer_in_one_shape_and_are_billed_their_own_tokens(mixed_fleet):
    fleet, proxy, llama_url = mixed_fleet
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.key, max_retries=0, timeout=120)
    seen: dict[int, list] = {}
    for i in range(16):  # different conversations: affinity spreads them over both workers
        messages = [{"role": "user", "content": f"Hello number {i}"}]
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        generation = _served_by(proxy, fleet, plain.id)
        seen.setdefault(generation["worker_id"], []).append((messages, chunks, plain, generation))
    assert set(seen) == set(fleet.worker_ids), "both engines served"

    llama_id = fleet.worker_ids[1]
    for worker_id, answers in seen.items():
        for messages, chunks, plain, generation in answers:
            assert {c.model for c in chunks} == {MODEL} and plain.model == MODEL
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
            assert all(c.usage is None for c in chunks[:-1])
            assert plain.usage.completion_tokens == 6 and plain.choices[0].message.role == "assistant"
            assert plain.choices[0].finish_reason == "length"
            assert generation["cost_nano_usd"] == generation["prompt_tokens"] * 150 + 6 * 600
            if worker_id == llama_id:  # llama.cpp's own count of the prompt is what was billed
                direct = httpx.post(llama_url + "/v1/chat/completions", timeout=60,
                                    json={"model": "tiny-llama", "messages": messages, "max_tokens": 1}).json()
                assert generation["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    settled = fleet.settlements()
    assert len(settled) == 32
    owner_llama = fleet.balance(fleet.owner_ids[1]).balance_nano_usd
    assert owner_llama == sum(s["charge_nano_usd"] * 80 // 100 for s in settled if s["owner_account_id"] == fleet.owner_ids[1])
    with fleet.engine.connect() as conn:
        assert verify(conn).ok
