"""Embeddings end to end: the official `openai` SDK's `client.embeddings.create`
against `paralon serve`, in front of simulated embedding workers and of
llama.cpp (llama-cpp-python's server on a tiny generated model, embeddings on).
Billed per input token at the model's input price, 80% to the worker's owner;
every failure leaves every balance as it was."""
from __future__ import annotations

import base64
import json
import os
import struct
from contextlib import contextmanager

import httpx
import openai
import orjson
import pytest
from click.testing import CliRunner
from sqlalchemy import select

from app.cli import main

from ledger import accounts as acc
from ledger import commands as cmd
from ledger.db import snapshot_connection
from ledger.schema import accounts
from ledger.service import append_now
from ledger.verify import verify
from proxy import prices
from proxy import workers as registry
from proxy.embeddings import Malformed, Vectors, billed_usage, input_tokens_bound, read_answer, read_request
from proxy.generations import generation_record
from proxy.errors import InvalidRequest
from proxy.limits import EMBEDDING_INPUTS_MAX, EMBEDDING_TOKENS_PER_INPUT
from proxy.sim.embeddings import prompt_tokens_of, route_of, vector_of
from tests.support import harness
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for
from tests.support.llamacpp_server import running_llamacpp_server
from tests.support.tiny_gguf import write_tiny_model

EMBED_MODEL = "paralon-embed"
INPUT_NANO_USD_PER_TOKEN = 20  # $0.02/MTok
LLAMACPP_CONTEXT_TOKENS = 512
SERVE_START_TIMEOUT_S = 300.0
LEFT_NANO_USD = 1_000  # a customer's balance too small for a long input


class EmbeddingFleet:
    """make_fleet's chat model and customer, plus embedding workers of owners of their own."""

    def __init__(self, database_url: str, embedding_urls: list[str], engines: list[str], chat_url: str) -> None:
        self.fleet = make_fleet(database_url, [chat_url])
        with self.fleet.engine.begin() as conn:
            self.owner_ids = [acc.create_account(conn, cmd.OWNER, f"embedding owner {i}") for i in range(len(embedding_urls))]
            self.worker_ids = [
                registry.add_worker(conn, owner, url, EMBED_MODEL, engine,
                                    LLAMACPP_CONTEXT_TOKENS if engine == "llamacpp" else None, registry.EMBEDDING)
                for owner, url, engine in zip(self.owner_ids, embedding_urls, engines)]
            prices.set_price(conn, EMBED_MODEL, "0.02", "0.001")
            self.platform_id = conn.execute(
                select(accounts.c.id).where(accounts.c.system_code == cmd.PLATFORM_REVENUE_ACCOUNT)).scalar_one()

    def balances(self) -> dict[int, tuple[int, int]]:
        """(balance, held) of the customer, the embedding owners, the chat owner and the platform."""
        ids = [self.fleet.customer_id, *self.owner_ids, *self.fleet.owner_ids, self.platform_id]
        return {i: (view.balance_nano_usd, view.held_nano_usd) for i in ids for view in [self.fleet.balance(i)]}

    def await_routable(self) -> None:
        """Until the chat worker and every embedding worker can be routed to."""
        self.fleet.await_routable(also=tuple(self.worker_ids))

    def client(self, proxy) -> openai.OpenAI:
        return openai.OpenAI(base_url=proxy.url + "/v1", api_key=self.fleet.key, max_retries=0, timeout=120)

    def generation(self, proxy, request_id: str) -> dict:
        """The customer's view of a request, with the worker the ledger recorded (customers are not shown it)."""
        shown = httpx.get(f"{proxy.url}/v1/generations/{request_id}", headers={"authorization": f"Bearer {self.fleet.key}"}).json()
        assert "worker_id" not in shown
        with self.fleet.engine.connect() as conn:
            return {**shown, "worker_id": generation_record(conn, request_id)["worker_id"]}


@pytest.fixture(autouse=True)
def patient_start(monkeypatch):
    """`paralon serve` may take long to import on a busy machine: wait for it rather than fail."""
    monkeypatch.setattr(harness, "START_TIMEOUT_S", SERVE_START_TIMEOUT_S)


@contextmanager
def _sim_embeddings(database_url: str):
    """Two simulated embedding workers (vLLM's API) and one chat worker."""
    workers = [sim_worker("instant", EMBED_MODEL), sim_worker("instant", EMBED_MODEL), sim_worker("instant")]
    try:
        fleet = EmbeddingFleet(database_url, [w.url for w in workers[:2]], ["vllm", "vllm"], workers[2].url)
        with serving(database_url) as proxy:
            fleet.await_routable()
            yield fleet, proxy, workers
        fleet.fleet.engine.dispose()
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
def sim_embeddings_on_both(database_url):
    with _sim_embeddings(database_url) as served:
        yield served


@pytest.fixture
def sim_embeddings(postgres_url):
    with _sim_embeddings(postgres_url) as served:
        yield served


def _settled_exactly(fleet: EmbeddingFleet, before: dict, charges: list[tuple[int, int]]) -> None:
    """The customer paid exactly the charges, each owner 80% of its own, the platform the rest; nothing stays held."""
    after = fleet.balances()
    total = sum(charge for charge, _ in charges)
    assert after[fleet.fleet.customer_id] == (before[fleet.fleet.customer_id][0] - total, 0)
    for owner in fleet.owner_ids:
        owed = sum(charge * 80 // 100 for charge, paid in charges if paid == owner)
        assert after[owner][0] - before[owner][0] == owed
    assert after[fleet.platform_id][0] - before[fleet.platform_id][0] == total - sum(c * 80 // 100 for c, _ in charges)
    with snapshot_connection(fleet.fleet.engine) as conn:  # the chain and every balance verify
        assert verify(conn).ok


def _nothing_moved(fleet: EmbeddingFleet, before: dict) -> None:
    assert fleet.balances() == before
    assert all(held == 0 for _, held in before.values())


def test_the_sdk_embeds_a_string_a_list_and_token_ids_billed_per_input_token(sim_embeddings_on_both):
    fleet, proxy, _ = sim_embeddings_on_both
    client = fleet.client(proxy)
    before = fleet.balances()
    charges = []

    raw = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input="The food was delicious", encoding_format="float")
    one = raw.parse()
    assert one.model == EMBED_MODEL and len(one.data) == 1
    assert one.data[0].embedding == vector_of("The food was delicious")
    assert one.usage.prompt_tokens == prompt_tokens_of("The food was delicious") == one.usage.total_tokens
    cost = int(raw.headers["x-paralon-cost-nano-usd"])
    assert cost == one.usage.prompt_tokens * INPUT_NANO_USD_PER_TOKEN
    assert raw.headers["content-type"] == "application/json"
    generation = fleet.generation(proxy, raw.headers["x-request-id"])
    assert generation["cost_nano_usd"] == cost and generation["completion_tokens"] == 0
    assert generation["prompt_tokens"] == one.usage.prompt_tokens and generation["model"] == EMBED_MODEL
    charges.append((cost, _owner_of(fleet, generation)))

    texts = ["first", "second input", "a third, longer input with more bytes in it"]
    listed = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input=texts)  # the SDK asks for base64 and decodes
    many = listed.parse()
    assert [d.index for d in many.data] == [0, 1, 2]
    for text, datum in zip(texts, many.data):
        assert datum.embedding == pytest.approx(vector_of(text), abs=1e-6)
    assert many.usage.prompt_tokens == sum(map(prompt_tokens_of, texts))
    charges.append((many.usage.prompt_tokens * INPUT_NANO_USD_PER_TOKEN,
                    _owner_of(fleet, fleet.generation(proxy, listed.headers["x-request-id"]))))

    encoded = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input=["bytes please"], encoding_format="base64")
    as_text = encoded.parse().data[0].embedding
    vector = vector_of("bytes please")
    assert as_text == base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    charges.append((encoded.parse().usage.prompt_tokens * INPUT_NANO_USD_PER_TOKEN,
                    _owner_of(fleet, fleet.generation(proxy, encoded.headers["x-request-id"]))))

    ids = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input=[[101, 2023, 102], [7, 8]], dimensions=8,
                                                     encoding_format="float")
    by_ids = ids.parse()
    assert [d.embedding for d in by_ids.data] == [vector_of([101, 2023, 102], 8), vector_of([7, 8], 8)]
    assert by_ids.usage.prompt_tokens == 5
    charges.append((5 * INPUT_NANO_USD_PER_TOKEN, _owner_of(fleet, fleet.generation(proxy, ids.headers["x-request-id"]))))

    _settled_exactly(fleet, before, charges)
    listed_models = {m.id for m in client.models.list()}
    assert {EMBED_MODEL, MODEL} <= listed_models


def _owner_of(fleet: EmbeddingFleet, generation: dict) -> int:
    return fleet.owner_ids[fleet.worker_ids.index(generation["worker_id"])]


def test_chat_and_embeddings_never_reach_each_others_workers(sim_embeddings):
    fleet, proxy, workers = sim_embeddings
    client = fleet.client(proxy)
    before = fleet.balances()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=EMBED_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "/v1/embeddings" in refused.value.message and refused.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=EMBED_MODEL, prompt="hi", max_tokens=4)
    assert "/v1/embeddings" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="hi")
    assert "/v1/chat/completions" in refused.value.message
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
    _nothing_moved(fleet, before)
    assert workers[2].app.state.requests_started == 0
    assert all(route_of(w.app).requests_served == 0 for w in workers[:2])


def test_a_worker_failing_before_it_answers_is_replaced_and_costs_nothing(sim_embeddings):
    fleet, proxy, workers = sim_embeddings
    client = fleet.client(proxy)
    failing, healthy = route_of(workers[0].app), route_of(workers[1].app)
    failing.fault = "fail"
    before = fleet.balances()
    charges = []
    for i in range(8):  # different inputs: rendezvous hashing sends some to the failing worker first
        raw = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input=f"input number {i}", encoding_format="float")
        generation = fleet.generation(proxy, raw.headers["x-request-id"])
        assert generation["worker_id"] == fleet.worker_ids[1]
        charges.append((int(raw.headers["x-paralon-cost-nano-usd"]), fleet.owner_ids[1]))
    assert failing.requests_failed > 0 and healthy.requests_served == 8
    _settled_exactly(fleet, before, charges)

    healthy.fault = "fail"
    before = fleet.balances()
    with pytest.raises(openai.InternalServerError) as failed:
        client.embeddings.create(model=EMBED_MODEL, input="nobody answers")
    assert failed.value.status_code == 503 and "nothing was charged" in failed.value.message
    _nothing_moved(fleet, before)


@pytest.mark.parametrize("fault", ["wrong_count", "bad_json"])
def test_a_malformed_answer_is_not_charged(sim_embeddings, fault):
    fleet, proxy, workers = sim_embeddings
    for worker in workers[:2]:
        route_of(worker.app).fault = fault
    before = fleet.balances()
    with pytest.raises(openai.InternalServerError) as failed:
        fleet.client(proxy).embeddings.create(model=EMBED_MODEL, input=["one", "two"])
    assert failed.value.status_code == 502
    _nothing_moved(fleet, before)
    assert fleet.fleet.events("RequestSettled") == 0


def test_a_report_above_the_bound_is_billed_at_the_bound_and_recorded(sim_embeddings):
    fleet, proxy, workers = sim_embeddings
    for worker in workers[:2]:
        worker.app.inflate_usage = 1000
    before = fleet.balances()
    raw = fleet.client(proxy).embeddings.with_raw_response.create(model=EMBED_MODEL, input="hello", encoding_format="float")
    bound = input_tokens_bound("hello")
    assert prompt_tokens_of("hello") * 1000 > bound
    assert raw.parse().usage.prompt_tokens == bound
    assert int(raw.headers["x-paralon-cost-nano-usd"]) == bound * INPUT_NANO_USD_PER_TOKEN
    generation = fleet.generation(proxy, raw.headers["x-request-id"])
    _settled_exactly(fleet, before, [(bound * INPUT_NANO_USD_PER_TOKEN, _owner_of(fleet, generation))])
    wait_for(lambda: fleet.fleet.events("UsageDiscrepancyRecorded") == 1)


def test_what_the_hold_cannot_cover_is_refused_before_any_worker_is_asked(sim_embeddings):
    fleet, proxy, workers = sim_embeddings
    client = fleet.client(proxy)
    credits = fleet.balances()[fleet.fleet.customer_id][0]
    append_now(fleet.fleet.engine, cmd.AdjustBalance(fleet.fleet.customer_id, LEFT_NANO_USD - credits, "spent elsewhere", "spent"))
    before = fleet.balances()
    too_much = "x" * (LEFT_NANO_USD // INPUT_NANO_USD_PER_TOKEN)  # its bound costs more than what is left
    with pytest.raises(openai.APIStatusError) as refused:
        client.embeddings.create(model=EMBED_MODEL, input=too_much)
    assert refused.value.status_code == 402
    for body, param in [({"input": ""}, "input"), ({"input": ["a", 3]}, "input"), ({"input": "a", "encoding_format": "hex"},
                        "encoding_format"), ({"input": "a", "dimensions": 0}, "dimensions"), ({"input": [[1, -2]]}, "input")]:
        answer = httpx.post(f"{proxy.url}/v1/embeddings", json={"model": EMBED_MODEL, **body},
                            headers={"authorization": f"Bearer {fleet.fleet.key}"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, body
    _nothing_moved(fleet, before)
    assert all(route_of(w.app).requests_served == 0 for w in workers[:2])


if os.environ.get("PARALON_REQUIRE_SERVICES") != "1":  # CI must run it, never skip it
    llama_server = pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is installed by `make venv`")


@pytest.fixture
def llama_embeddings(tmp_path):
    database_url = f"sqlite:///{tmp_path}/paralon.db"
    model_path = write_tiny_model(tmp_path / "tiny.gguf")
    chat = sim_worker("instant")
    with running_llamacpp_server(model_path, "tiny-embed", n_ctx=LLAMACPP_CONTEXT_TOKENS, embedding=True) as llama_url:
        fleet = EmbeddingFleet(database_url, [llama_url], ["llamacpp"], chat.url)
        with serving(database_url) as proxy:
            fleet.await_routable()
            yield fleet, proxy, llama_url
    chat.stop()
    fleet.fleet.engine.dispose()


def test_llamacpp_embeds_through_the_proxy_billed_from_its_own_usage(llama_embeddings):
    fleet, proxy, llama_url = llama_embeddings
    client = fleet.client(proxy)
    before = fleet.balances()
    texts = ["hello world", "embeddings from a real engine"]
    raw = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input=texts, encoding_format="float")
    answer = raw.parse()
    direct = httpx.post(llama_url + "/v1/embeddings", json={"model": "tiny-embed", "input": texts}, timeout=60).json()
    assert answer.usage.prompt_tokens == direct["usage"]["prompt_tokens"] > 0
    assert [d.embedding for d in answer.data] == [d["embedding"] for d in direct["data"]]
    assert len(answer.data[0].embedding) == 64
    cost = answer.usage.prompt_tokens * INPUT_NANO_USD_PER_TOKEN
    assert int(raw.headers["x-paralon-cost-nano-usd"]) == cost
    decoded = client.embeddings.create(model=EMBED_MODEL, input="hello world")  # base64, decoded by the SDK
    assert decoded.data[0].embedding == pytest.approx(direct["data"][0]["embedding"], abs=1e-6)
    _settled_exactly(fleet, before, [(cost, fleet.owner_ids[0]),
                                     (decoded.usage.prompt_tokens * INPUT_NANO_USD_PER_TOKEN, fleet.owner_ids[0])])

    before = fleet.balances()
    with pytest.raises(openai.BadRequestError) as refused:  # llama-cpp-python would ignore it and answer 64 numbers
        client.embeddings.create(model=EMBED_MODEL, input="hello", dimensions=8)
    assert refused.value.body["param"] == "dimensions"
    _nothing_moved(fleet, before)


def test_an_owner_registers_an_embedding_worker_from_the_command_line(database_url):
    def paralon(*args):
        result = CliRunner().invoke(main, [*args, "--json"], env={"PARALON_DATABASE_URL": database_url}, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    paralon("migrate")
    owner = paralon("accounts", "create", "--kind", "owner", "--name", "GPU owner")["id"]
    added = paralon("workers", "add", "--owner", str(owner), "--url", "http://10.0.0.7:8000", "--model", EMBED_MODEL,
                    "--task", "embedding")
    chat = paralon("workers", "add", "--owner", str(owner), "--url", "http://10.0.0.8:8000", "--model", MODEL)
    assert (added["task"], chat["task"]) == ("embedding", "chat")
    listed = {w["id"]: w["task"] for w in paralon("workers", "list")["workers"]}
    assert listed == {added["id"]: "embedding", chat["id"]: "chat"}
    refused = CliRunner().invoke(main, ["workers", "add", "--owner", str(owner), "--url", "http://h:1", "--model", "m",
                                        "--task", "rerank"], env={"PARALON_DATABASE_URL": database_url})
    assert refused.exit_code == 2


def test_an_answer_is_usable_only_with_one_vector_of_numbers_per_input_all_as_long():
    def raw(data, usage=None):
        return orjson.dumps({"data": data, "usage": usage or {"prompt_tokens": 3}})

    good = read_answer(raw([{"index": 1, "embedding": [0.5, 1]}, {"index": 0, "embedding": [0.25, -1.0]}]), 2, None)
    assert good == Vectors([[0.25, -1.0], [0.5, 1]], 3)
    assert read_answer(raw([{"index": 0, "embedding": [1.0]}], {"prompt_tokens": -1}), 1, None).reported_prompt_tokens is None
    for bad, count, dimensions in [
        (b"{", 1, None),
        (raw([{"index": 0, "embedding": [1.0]}]), 2, None),  # a vector missing
        (raw([{"index": 0, "embedding": [1.0]}, {"index": 0, "embedding": [1.0]}]), 2, None),  # an index twice
        (raw([{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [1.0, 2.0]}]), 2, None),  # widths differ
        (raw([{"index": 0, "embedding": [1.0, 2.0]}]), 1, 3),  # not the dimensions asked for
        (raw([{"index": 0, "embedding": ["1.0"]}]), 1, None),
        (raw([{"index": 0, "embedding": [True]}]), 1, None),
        (raw([{"index": 0, "embedding": []}]), 1, None),
        (raw([{"index": 0, "embedding": [1e300]}]), 1, None),  # no float32 holds it: base64 could not pack it after the charge
    ]:
        with pytest.raises(Malformed):
            read_answer(bad, count, dimensions)


def test_the_bill_is_the_report_within_the_bound_else_the_bound():
    price = prices.Price(INPUT_NANO_USD_PER_TOKEN, 1)
    assert billed_usage(7, 9, price) == (7, 7 * INPUT_NANO_USD_PER_TOKEN, False)
    assert billed_usage(10, 9, price) == (9, 9 * INPUT_NANO_USD_PER_TOKEN, True)
    assert billed_usage(None, 9, price) == (9, 9 * INPUT_NANO_USD_PER_TOKEN, False)
    assert billed_usage(0, 9, price) == (0, 0, False)
    ask = read_request({"model": "m", "input": ["héllo", "ab"], "encoding_format": "base64", "user": "u"})
    assert ask.bound_tokens == len("héllo".encode()) + 2 + 2 * EMBEDDING_TOKENS_PER_INPUT and ask.base64
    assert read_request({"model": "m", "input": [5, 6, 7]}).inputs == [[5, 6, 7]]
    with pytest.raises(InvalidRequest):
        read_request({"model": "m", "input": [[1]] * (EMBEDDING_INPUTS_MAX + 1)})
