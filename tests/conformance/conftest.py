"""One real `paralon serve` on PostgreSQL per test process, the clients'
traffic recorded, and the checks every conformance test ends with.

The serve fronts three models:
- `paralon-test`: a simulated vLLM worker (proxy/sim/), plain text;
- `paralon-agent`: tests/support/agent_worker.py, which answers with tool
  calls, logprobs, reasoning and JSON that matches a requested schema;
- `paralon-embed`: a simulated worker serving `/v1/embeddings`.
A test asks for `paralon` and ends with `paralon.check()`: every body and SSE
event the clients received matches OpenAI's OpenAPI document, and the
customer lost exactly what the answers said they cost (the sum of the
settlements, each owner 80% of each)."""
from __future__ import annotations

import os

# litellm reads this when it is imported: its price list from the package, not from the internet.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

from contextlib import ExitStack  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from ledger import accounts as acc  # noqa: E402
from ledger import commands as cmd  # noqa: E402
from ledger.money import usd_to_nano_usd  # noqa: E402
from ledger.service import append_now  # noqa: E402
from proxy import keys, prices  # noqa: E402
from proxy import workers as registry  # noqa: E402
from tests.conformance.recording import Recorder, reported_cost_nano_usd  # noqa: E402
from tests.conftest import drop_postgres_database_soon, new_postgres_database  # noqa: E402
from tests.support import harness  # noqa: E402
from tests.support.harness import MODEL, Fleet, make_fleet, serving, sim_worker, wait_for  # noqa: E402
from tests.support.agent_worker import start_agent_worker  # noqa: E402

AGENT_MODEL = "paralon-agent"
EMBEDDING_MODEL = "paralon-embed"
OWNER_SHARE_PERCENT = 80
CREDITS_USD = "10"
SPEND_LIMIT_USD = "0.000001"  # below the smallest hold: every request on this key meets its limit
# Every warning a client raises fails its test, but for a finaliser's: an event loop or socket
# that another test or a client library left behind may be collected during this test, and its
# warning says nothing about this test's answers. The last filter wins.
CLIENT_WARNINGS_ARE_ERRORS = [
    pytest.mark.filterwarnings("error"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
# litellm builds a pydantic schema of its own GitHub Copilot types on its first call, whatever
# the server, and pydantic warns about some of them (`_DeviceCode`, `ChatCompletionThinkingBlock`,
# …: TypedDicts with `ReadOnly` items); that warning says nothing about the answers.
LITELLM_SCHEMA_WARNING = pytest.mark.filterwarnings(
    r"ignore:Items? .* on TypedDict class '\w+' (is|are) using the `ReadOnly` qualifier:UserWarning")
SETTLED_WAIT_S = 20.0
TEXT_ANSWER_TOKENS = 12
SERVE_START_TIMEOUT_S = 120.0


@dataclass
class Served:
    """The running serve and who may call it."""

    url: str
    fleet: Fleet
    key: str
    broke_key: str  # a customer with no credits (402)
    limited_key: str  # a key whose spend limit no request fits under (429)
    models: dict[str, str]  # what each kind of test calls: text, agent, embedding
    owners: list[int]

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def _add_model(fleet: Fleet, url: str, model: str, **task) -> int:
    with fleet.engine.begin() as conn:
        owner = acc.create_account(conn, cmd.OWNER, f"owner of {model}")
        registry.add_worker(conn, owner, url, model, "vllm", None, **task)
        prices.set_price(conn, model, "0.15", "0.60")
    return owner


def _extra_keys(fleet: Fleet) -> tuple[str, str]:
    with fleet.engine.begin() as conn:
        broke = acc.create_account(conn, cmd.CUSTOMER, "customer without credits", "broke@example.com")
        _, broke_key = keys.create_key(conn, broke)
        limited = acc.create_account(conn, cmd.CUSTOMER, "customer with a spend limit", "limited@example.com")
        _, limited_key = keys.create_key(conn, limited, spend_limit_nano_usd=usd_to_nano_usd(SPEND_LIMIT_USD))
    append_now(fleet.engine, cmd.GrantCredits(limited, usd_to_nano_usd(CREDITS_USD), "test credits", f"grant:{limited}"))
    return broke_key, limited_key


@pytest.fixture(scope="session")
def conformance_serve(request, tmp_path_factory):
    """One `paralon serve` for this test process; every worker and the serve stop when the session ends."""
    database_url = new_postgres_database(template=request.getfixturevalue("postgres_template"))
    request.addfinalizer(lambda: drop_postgres_database_soon(database_url))
    scratch = tmp_path_factory.mktemp("conformance-serve")
    with ExitStack() as stack:
        # Answers end by themselves after TEXT_ANSWER_TOKENS: below that, max_tokens cuts them ("length").
        text_worker = sim_worker("instant", stop_after_tokens=TEXT_ANSWER_TOKENS)
        stack.callback(text_worker.stop)
        agent_worker = start_agent_worker(model=AGENT_MODEL)
        stack.callback(agent_worker.stop)
        fleet = make_fleet(database_url, [text_worker.url], credits_usd=CREDITS_USD)
        stack.callback(fleet.engine.dispose)
        models = {"text": MODEL, "agent": AGENT_MODEL, "embedding": EMBEDDING_MODEL}
        fleet.owner_ids.append(_add_model(fleet, agent_worker.url, AGENT_MODEL))
        embedding_worker = sim_worker("instant", model=EMBEDDING_MODEL)
        stack.callback(embedding_worker.stop)
        fleet.owner_ids.append(_add_model(fleet, embedding_worker.url, EMBEDDING_MODEL, task=registry.EMBEDDING))
        broke_key, limited_key = _extra_keys(fleet)
        closing_pipe = stack.enter_context(ExitStack())  # runs after the serve stopped: its output pipe is closed
        with pytest.MonkeyPatch.context() as patch:  # only while it starts: a loaded CI machine is slow to import it
            patch.setattr(harness, "START_TIMEOUT_S", SERVE_START_TIMEOUT_S)
            proxy = stack.enter_context(serving(database_url, PARALON_ANCHOR_FILE=str(scratch / "anchors.jsonl"),
                                                PARALON_WITHHELD_JOURNAL_DIR=str(scratch / "withheld")))
        closing_pipe.callback(proxy.process.stdout.close)
        yield Served(proxy.url, fleet, fleet.key, broke_key, limited_key, models, fleet.owner_ids)


def documented_paths(served: Served) -> set[str]:
    return set(httpx.get(served.url + "/docs/openapi.json").json()["paths"])


@dataclass
class Paralon:
    """What a conformance test works with: the serve, its recorded traffic, the money check."""

    served: Served
    recorder: Recorder
    customer_before_nano_usd: int = 0
    owners_before_nano_usd: dict[int, int] = field(default_factory=dict)
    settled_before: set[str] = field(default_factory=set)
    checked: bool = False
    clients: list = field(default_factory=list)  # closed when the test ends: no socket left to the garbage collector

    @property
    def base_url(self) -> str:
        return self.served.base_url

    @property
    def key(self) -> str:
        return self.served.key

    def model(self, kind: str = "text") -> str:
        if kind not in self.served.models:
            pytest.fail(f"the serve has no {kind} model (the simulated worker does not serve it)")
        return self.served.models[kind]

    def openai(self, **options) -> openai.OpenAI:
        client = openai.OpenAI(base_url=self.base_url, api_key=options.pop("api_key", self.key), **options)
        self.clients.append(client)
        return client

    def async_openai(self, **options) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=options.pop("api_key", self.key), **options)

    def requires_route(self, path: str) -> None:
        if path not in documented_paths(self.served):
            pytest.fail(f"this serve has no {path} route")

    def start(self) -> "Paralon":
        fleet = self.served.fleet
        wait_for(lambda: fleet.balance(fleet.customer_id).held_nano_usd == 0, SETTLED_WAIT_S)
        self.customer_before_nano_usd = fleet.balance(fleet.customer_id).balance_nano_usd
        self.owners_before_nano_usd = {o: fleet.balance(o).balance_nano_usd for o in self.served.owners}
        self.settled_before = {s["request_id"] for s in fleet.settlements()}
        return self

    def check(self) -> None:
        """Every recorded body and event conforms; the customer paid exactly what the answers said."""
        self.checked = True
        documents = self.recorder.assert_conforms()
        assert documents > 0, "the clients received nothing from the serve"
        self.assert_paid_exactly()

    def reported_costs(self) -> dict[str, int]:
        costs = {}
        for exchange in self.recorder.exchanges:
            if not exchange.paid:
                continue
            assert exchange.request_id, f"{exchange}: a paid answer without x-request-id"
            cost = reported_cost_nano_usd(exchange)
            costs[exchange.request_id] = self._generation_cost(exchange.request_id) if cost is None else cost
        return costs

    def _generation_cost(self, request_id: str) -> int:
        """What /v1/generations recorded, for a stream whose caller asked for no usage."""
        answer = httpx.get(f"{self.base_url}/generations/{request_id}", headers={"authorization": f"Bearer {self.key}"})
        return answer.json()["cost_nano_usd"] if answer.status_code == 200 else 0

    def assert_paid_exactly(self) -> None:
        fleet = self.served.fleet
        wait_for(lambda: fleet.balance(fleet.customer_id).held_nano_usd == 0, SETTLED_WAIT_S)
        reported = self.reported_costs()
        settled = {s["request_id"]: s for s in fleet.settlements() if s["request_id"] not in self.settled_before}
        assert set(settled) <= set(reported), f"settled without an answer the caller saw: {set(settled) - set(reported)}"
        for request_id, cost in reported.items():
            charge = settled[request_id]["charge_nano_usd"] if request_id in settled else 0
            assert charge == cost, f"{request_id}: the answer said {cost} nano-USD, the ledger charged {charge}"
        drop = self.customer_before_nano_usd - fleet.balance(fleet.customer_id).balance_nano_usd
        assert drop == sum(reported.values()), f"the customer lost {drop} nano-USD, the answers said {sum(reported.values())}"
        for owner, before in self.owners_before_nano_usd.items():
            theirs = [s for s in settled.values() if s["owner_account_id"] == owner]
            assert all(s["owner_nano_usd"] == s["charge_nano_usd"] * OWNER_SHARE_PERCENT // 100 for s in theirs)
            assert fleet.balance(owner).balance_nano_usd - before == sum(s["owner_nano_usd"] for s in theirs)


@pytest.fixture
def paralon(conformance_serve, monkeypatch, request):
    recorder = Recorder(conformance_serve.url)
    recorder.install(monkeypatch)
    for variable, value in (("PARALON_BASE_URL", conformance_serve.base_url), ("PARALON_API_KEY", conformance_serve.key)):
        monkeypatch.setenv(variable, value)
    session = Paralon(conformance_serve, recorder).start()
    yield session
    for client in session.clients:
        client.close()
    report = getattr(request.node, "call_report", None)
    if report is not None and report.passed and not session.checked:
        pytest.fail("a conformance test must end with paralon.check()")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.call_report = report
    return report

