"""Long prompts reach the worker that holds them (issue: every OpenAI client
works unchanged, "a prompt that fits is refused").

A mixed fleet as operators run it: one simulated worker of 262,144 tokens of
context and three of 32,768, behind a real `paralon serve`, the official
`openai` SDK as client. The byte bound of a prompt is about four times what
the workers count, so near a context limit the proxy asks a worker's
/tokenize (proxy/tokenize.py). Prompts are sized by the simulated worker's
own count (proxy/sim/requests.py: UTF-8 bytes // 4 + 4 per message). Every
answer is checked against exact balances: the customer's, and each owner's."""
from __future__ import annotations

from types import SimpleNamespace

import asyncio
import time
from datetime import UTC, datetime

import openai
import pytest

from ledger import accounts as acc
from ledger import commands as cmd
from ledger.money import PERCENT
from ledger.service import append_now
from proxy import keys, metering, routing, tokenize
from proxy import workers as registry
from proxy.limits import DIRECTORY_REFRESH_INTERVAL_S, SIM_PROMPT_BYTES_PER_TOKEN, SIM_PROMPT_TOKENS_PER_MESSAGE
from proxy.keys import KeyGrant
from proxy.prices import Price
from proxy.service import InferenceProxy
from proxy.sim.tokenize import tokenize_route
from proxy.upstream import UpstreamPool
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for

LARGE_CONTEXT_TOKENS = 262_144
SMALL_CONTEXT_TOKENS = 32_768
COMPLETION_TOKENS = 8  # every simulated worker stops after this many
INPUT_NANO_USD_PER_TOKEN, OUTPUT_NANO_USD_PER_TOKEN = 150, 600  # make_fleet's prices, 0.15 and 0.60 USD per million
OWNER_SHARE_PERCENT = 80


def _messages(tokens: int, salt: str = "") -> list[dict]:
    """One user message the simulated worker counts as exactly `tokens` tokens."""
    content_bytes = (tokens - SIM_PROMPT_TOKENS_PER_MESSAGE) * SIM_PROMPT_BYTES_PER_TOKEN
    head = f"{salt} long document follows: "
    return [{"role": "user", "content": head + "x" * (content_bytes - len(head))}]


def _charge(prompt_tokens: int, completion_tokens: int = COMPLETION_TOKENS) -> int:
    return prompt_tokens * INPUT_NANO_USD_PER_TOKEN + completion_tokens * OUTPUT_NANO_USD_PER_TOKEN


class MixedFleet:
    def __init__(self, database_url: str) -> None:
        contexts = [LARGE_CONTEXT_TOKENS] + [SMALL_CONTEXT_TOKENS] * 3
        self.sims = [sim_worker("instant", max_model_len=c, stop_after_tokens=COMPLETION_TOKENS) for c in contexts]
        self.fleet = make_fleet(database_url, [s.url for s in self.sims])
        self.large_id = self.fleet.worker_ids[0]

    def served(self) -> list[int]:
        """Requests each worker finished, in the fleet's order (the large one first)."""
        return [s.app.state.requests_finished for s in self.sims]

    def served_once_finished(self, total: int) -> list[int]:
        """`served`, once `total` requests in all have finished: a worker counts a request after
        its last byte is sent, so its caller can hold the answer before the count moves."""
        wait_for(lambda: sum(self.served()) >= total)
        return self.served()

    def tokenize_calls(self) -> list[int]:
        return [tokenize_route(s.app).calls for s in self.sims]

    def balances(self) -> tuple[int, int, list[int]]:
        """Once the pools are released: the customer's held sum is 0 only then."""
        self.fleet.pools_released()
        customer = self.fleet.balance(self.fleet.customer_id)
        return customer.balance_nano_usd, customer.held_nano_usd, [self.fleet.balance(o).balance_nano_usd
                                                                     for o in self.fleet.owner_ids]

    def views(self) -> list[registry.WorkerView]:
        return [self.fleet.worker(w) for w in self.fleet.worker_ids]

    def stop(self) -> None:
        for sim in self.sims:
            sim.stop()
        self.fleet.engine.dispose()


@pytest.fixture
def mixed(database_url):
    fleet = MixedFleet(database_url)
    try:
        with serving(database_url) as proxy:
            # the health checks read every worker's context length; the proxy's directory follows within its interval
            wait_for(lambda: all(v.context_length and v.healthy for v in fleet.views()))
            time.sleep(2 * DIRECTORY_REFRESH_INTERVAL_S)
            yield fleet, openai.OpenAI(base_url=proxy.url + "/v1", api_key=fleet.fleet.key, max_retries=0, timeout=120)
    finally:
        fleet.stop()


def _first_choice_is_small(mixed: MixedFleet, messages: list[dict]) -> bool:
    """Would rendezvous routing try a small worker first for these messages?"""
    views = mixed.views()
    idle = {v.id: routing.WorkerLoadView(0, 0, None) for v in views}
    return routing.order(routing.affinity_key(MODEL, {"messages": messages}), views, idle).workers[0].id != mixed.large_id


def _deltas(now: list[int], before: list[int]) -> list[int]:
    return [n - b for n, b in zip(now, before)]


def test_long_prompts_reach_the_worker_that_holds_them_and_short_ones_any_worker_uncounted(mixed):
    fleet, client = mixed
    before = fleet.balances()[0]
    for i in range(12):  # no max_tokens: each worker is sent the room its own context leaves
        short = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"question {i}"}])
        assert short.choices[0].finish_reason == "stop"
    assert fleet.tokenize_calls() == [0, 0, 0, 0], "a short prompt is never counted"
    assert sum(fleet.served()[1:]) > 0, "short prompts spread over the small workers too"
    short_charges = sum(s["charge_nano_usd"] for s in fleet.fleet.settlements())
    owners_before = fleet.balances()[2]

    served = fleet.served()
    answer = client.chat.completions.create(model=MODEL, messages=_messages(180_000), max_tokens=16)
    assert answer.usage.prompt_tokens == 180_000 and answer.usage.completion_tokens == COMPLETION_TOKENS
    assert _deltas(fleet.served_once_finished(sum(served) + 1), served) == [1, 0, 0, 0], "only the worker of 262,144 tokens holds it"
    charge_180k = _charge(180_000)
    after, held, owners = fleet.balances()
    assert (after, held) == (before - short_charges - charge_180k, 0), "billed exactly what the worker counted"
    assert owners == [owners_before[0] + charge_180k * OWNER_SHARE_PERCENT // PERCENT, *owners_before[1:]]
    assert fleet.fleet.settlements()[-1]["meta"]["worker_id"] == fleet.large_id

    served = fleet.served()
    messages = _messages(40_000)
    for _ in range(3):  # an agent retrying the same prompt: counted once
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
        assert answer.usage.prompt_tokens == 40_000
    assert _deltas(fleet.served_once_finished(sum(served) + 3), served) == [3, 0, 0, 0], "40,000 tokens: only the large worker holds them"
    assert sum(fleet.tokenize_calls()) == 2, "one count for the 180k prompt, one for the 40k one"
    assert fleet.balances()[:2] == (before - short_charges - charge_180k - 3 * _charge(40_000), 0)
    fleet.fleet.assert_books_close()


def test_too_long_for_every_worker_is_400_with_no_money_moved_and_a_high_count_bills_at_most_the_byte_bound(mixed):
    fleet, client = mixed
    before = fleet.balances()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=_messages(300_000), max_tokens=16)
    assert refused.value.code == "context_length_exceeded"
    assert fleet.balances() == before, "nothing held, nothing charged"
    assert fleet.served() == [0, 0, 0, 0]
    assert sum(fleet.tokenize_calls()) == 2, "a second worker confirmed the count before the refusal"
    with pytest.raises(openai.BadRequestError):  # it fits, but leaves no room for what was asked
        client.chat.completions.create(model=MODEL, messages=_messages(262_000), max_tokens=10_000)
    assert fleet.balances() == before

    # The large worker (asked first: it holds long prompts) counts ten times the
    # prompt and reports ten times its usage: billed at the byte bound, no more.
    tokenize_route(fleet.sims[0].app).count_percent = 10 * PERCENT
    fleet.sims[0].app.inflate_usage = 10
    messages = _messages(40_000)
    byte_bound = metering.prompt_tokens_bound("chat", {"messages": messages})
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=COMPLETION_TOKENS)
    assert fleet.served_once_finished(1) == [1, 0, 0, 0]
    charge = _charge(byte_bound)
    assert [s["charge_nano_usd"] for s in fleet.fleet.settlements()] == [charge]
    assert fleet.balances()[:2] == (before[0] - charge, 0)
    fleet.fleet.assert_books_close()


def test_a_count_that_lies_low_is_retried_on_a_larger_worker_and_charged_once(mixed):
    """The large worker (asked first) counts a quarter of the prompt, so the
    proxy tries a small worker, whose own "too long" is retried on the large
    one, which is paid for the prompt it reports: a count places a prompt and
    sizes its hold, it never lowers what is billed (the byte bound does), so no
    worker's count can cut another owner's pay: the part of the prompt above
    the hold is charged under a hold of its own. The count is then distrusted,
    and an honest worker counts the same prompt next time."""
    fleet, client = mixed
    tokenize_route(fleet.sims[0].app).count_percent = PERCENT // 4
    messages = next(m for m in (_messages(40_000, f"try {i}") for i in range(64)) if _first_choice_is_small(fleet, m))
    before, _, owners_before = fleet.balances()
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    assert answer.choices[0].message.content
    assert fleet.served_once_finished(1) == [1, 0, 0, 0]
    charge = _charge(40_000)
    settled = fleet.fleet.settlements()
    assert sum(s["charge_nano_usd"] for s in settled) == charge, "charged once, for the prompt as counted by its worker"
    assert [(s["meta"]["prompt_tokens"], s["meta"]["completion_tokens"]) for s in settled] == [
        (settled[0]["meta"]["prompt_tokens"], COMPLETION_TOKENS), (40_000 - settled[0]["meta"]["prompt_tokens"], 0)], \
        "the hold covered the completion and the prompt as the low count sized it; the rest had a hold of its own"
    assert all(s["charge_nano_usd"] == _charge(s["meta"]["prompt_tokens"], s["meta"]["completion_tokens"]) for s in settled)
    after, held, owners = fleet.balances()
    assert (after, held) == (before - charge, 0)
    assert owners == [owners_before[0] + charge * OWNER_SHARE_PERCENT // PERCENT, *owners_before[1:]]
    # the same prompt again: an honest small worker counts it, the large one serves it, billed exactly
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    assert sum(fleet.tokenize_calls()[1:]) == 1 and fleet.served_once_finished(2) == [2, 0, 0, 0]
    assert fleet.balances()[0] == before - 2 * charge
    fleet.fleet.assert_books_close()


def _view(worker_id: int, context_length: int) -> registry.WorkerView:
    return registry.WorkerView(worker_id, 100 + worker_id, f"http://127.0.0.1:{9000 + worker_id}", MODEL, "vllm", "active",
                               context_length, None, True, None, datetime.now(UTC), None, None, 0, None, None)


class _Directory:
    """What planning reads of the directory: prices and the fleet."""

    def __init__(self, fleet: list[registry.WorkerView]) -> None:
        self.prices = {MODEL: Price(INPUT_NANO_USD_PER_TOKEN, OUTPUT_NANO_USD_PER_TOKEN)}
        self.fleet, self.loads = {MODEL: fleet}, {}


def test_short_prompts_are_planned_without_a_count():
    """The decision is made before any I/O: a prompt whose byte bound fits
    every worker is planned at once; a longer one is planned on a count."""
    directory = _Directory([_view(1, LARGE_CONTEXT_TOKENS), _view(2, SMALL_CONTEXT_TOKENS)])
    proxy = InferenceProxy(ledger=SimpleNamespace(engine=None), directory=directory, upstream=UpstreamPool())  # plans only: no database
    grant = KeyGrant(1, 1, None)
    short = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 20_000}]}
    generation, candidates, _ = proxy._prepare("chat", short, grant)
    assert [w.id for w in candidates] == [1, 2]
    assert generation.prompt_bound == metering.prompt_tokens_bound("chat", short)
    long = {"model": MODEL, "messages": _messages(10_000)}
    assert proxy._prepare("chat", long, grant) is None, "its byte bound does not fit the small worker: count it"
    generation, candidates, _ = proxy._prepare("chat", long, grant, 10_000, counted_asked=True)
    assert [w.id for w in candidates] == [1, 2] and generation.context_bound == 10_000 + 100
    assert generation.prompt_bound == metering.prompt_tokens_bound("chat", long), "held and billed on the byte bound"
    uncounted, _, _ = proxy._prepare("chat", long, grant, None, counted_asked=True)
    assert uncounted.context_bound == metering.prompt_tokens_bound("chat", long), "no answer: the byte bound"
    token_ids = {"model": MODEL, "prompt": [1] * 40_000}
    assert proxy._prepare("completions", token_ids, grant) is not None, "token ids are their own count"


def test_the_counter_asks_the_largest_worker_once_per_prompt_and_another_once_distrusted():
    large, small = (sim_worker("instant", max_model_len=c) for c in (LARGE_CONTEXT_TOKENS, SMALL_CONTEXT_TOKENS))
    gone = _view(3, LARGE_CONTEXT_TOKENS)._replace(url="http://127.0.0.1:1")  # nothing listens there
    try:
        fleet = [_view(1, LARGE_CONTEXT_TOKENS)._replace(url=large.url), _view(2, SMALL_CONTEXT_TOKENS)._replace(url=small.url)]
        forwarded = {"messages": _messages(50_000)}

        async def scenario() -> list:
            counter = tokenize.PromptCounter(UpstreamPool())
            first = await counter.count(MODEL, "chat", forwarded, fleet)
            again = await counter.count(MODEL, "chat", forwarded, fleet)
            counter.distrust(MODEL, "chat", forwarded)
            recounted = await counter.count(MODEL, "chat", forwarded, fleet)
            unreachable = await tokenize.PromptCounter(UpstreamPool()).count(MODEL, "chat", forwarded, [gone])
            return [first, again, recounted, unreachable]

        first, again, recounted, unreachable = asyncio.run(scenario())
        assert first == again == tokenize.Counted(50_000, 1), "the largest context first, then from the cache"
        assert recounted == tokenize.Counted(50_000, 2), "a distrusted worker is asked last"
        assert unreachable is None, "no answer: the byte bound routes"
        assert (tokenize_route(large.app).calls, tokenize_route(small.app).calls) == (1, 1)
    finally:
        large.stop(), small.stop()


def test_a_long_prompts_hold_is_sized_by_the_count_so_a_balance_that_covers_it_is_not_refused(mixed):
    """A customer with $0.02 sends a 90,000-token prompt: held at the count
    (about $0.0136), it is served and charged exactly; held at the byte bound
    (about four times that) it was refused with 402."""
    fleet, client = mixed
    engine = fleet.fleet.engine
    credits_nano_usd = 20_000_000
    with engine.begin() as conn:
        customer = acc.create_account(conn, cmd.CUSTOMER, "small balance", "small@example.com")
        _, key = keys.create_key(conn, customer)
    append_now(engine, cmd.GrantCredits(customer, credits_nano_usd, "test credits", f"grant:{customer}"))
    messages = _messages(90_000, "small balance")
    byte_bound = metering.prompt_tokens_bound("chat", {"messages": messages})
    assert byte_bound * INPUT_NANO_USD_PER_TOKEN > credits_nano_usd, "the byte bound alone is more than the balance"
    small = openai.OpenAI(base_url=str(client.base_url), api_key=key, max_retries=0, timeout=120)
    owners_before = fleet.balances()[2]
    answer = small.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    assert answer.usage.prompt_tokens == 90_000
    charge = _charge(90_000)
    balance = fleet.fleet.balance(customer)
    assert (balance.balance_nano_usd, balance.held_nano_usd) == (credits_nano_usd - charge, 0)
    owners_gain = sum(after - before for after, before in zip(fleet.balances()[2], owners_before))
    assert owners_gain == charge * OWNER_SHARE_PERCENT // PERCENT
    fleet.fleet.assert_books_close()
