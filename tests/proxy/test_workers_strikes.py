"""Strikes a caller cannot cause, suspensions with their evidence, and agent
traffic that never strikes an honest worker.

A strike needs proof on one request (more completion reported than the proxy
relayed), or a prompt reported above the proxy's bound on requests of
PROMPT_INFLATION_ACCOUNTS_MIN different accounts; every discrepancy is an
event either way. Real `paralon serve` processes, the simulated worker (bare,
or behind a small ASGI layer that rewrites the usage it reports), and exact
nano-dollar balances."""
from __future__ import annotations

import asyncio
import random
import re
from datetime import timedelta

import httpx
import openai
import orjson
from sqlalchemy import select, update

from ledger import accounts as acc
from ledger import commands as cmd
from ledger.money import usd_to_nano_usd
from ledger.schema import accounts, ledger_events
from ledger.service import append_now
from proxy import keys, limits, metering
from proxy import workers as registry
from proxy.schema import usage_evidence
from proxy.sim.worker import build_app
from tests.support.harness import MODEL, Fleet, ThreadedServer, make_fleet, serving, wait_for

CREDITS_USD = "10"
INPUT_NANO_USD_PER_TOKEN, OUTPUT_NANO_USD_PER_TOKEN = 150, 600  # make_fleet's prices
MAX_TOKENS = 4
PROMPT_REPORTED_INFLATED = 1_000_000  # above any bound of these short prompts


class UsageRewriter:
    """A worker in front of the simulated one that reports its prompt as
    `prompt_tokens(body)` instead: an inflating worker, or one that counts
    what the chat template renders as a real engine does."""

    USAGE = re.compile(rb'"prompt_tokens":\d+')

    def __init__(self, inner, prompt_tokens) -> None:
        self.inner, self.prompt_tokens = inner, prompt_tokens

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.inner(scope, receive, send)
        chunks, message = [], {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            chunks.append(message.get("body", b""))
        body = b"".join(chunks)
        reported = b'"prompt_tokens":%d' % self.prompt_tokens(orjson.loads(body))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def rewrite(event):
            if event["type"] == "http.response.body" and event.get("body"):
                event = {**event, "body": self.USAGE.sub(reported, event["body"])}
            await send(event)

        await self.inner(scope, replay, rewrite)


def rewriting_worker(prompt_tokens, profile: str = "instant", **options) -> ThreadedServer:
    return ThreadedServer(UsageRewriter(build_app(profile, MODEL, **options), prompt_tokens)).start()


def more_customers(fleet: Fleet, count: int) -> list[tuple[int, str]]:
    """Customers of their own, each with credits and a key: (account id, key)."""
    made = []
    with fleet.engine.begin() as conn:
        for i in range(count):
            account = acc.create_account(conn, cmd.CUSTOMER, f"customer {i}")
            made.append((account, keys.create_key(conn, account)[1]))
    for account, _ in made:
        append_now(fleet.engine, cmd.GrantCredits(account, usd_to_nano_usd(CREDITS_USD), "test credits", f"grant:{account}"))
    return made


def chat(proxy, key: str, content: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS}
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def prompt_bound(content: str) -> int:
    return metering.prompt_tokens_bound("chat", {"messages": [{"role": "user", "content": content}]})


def discrepancies(fleet: Fleet) -> list[dict]:
    return _payloads(fleet, "UsageDiscrepancyRecorded")


def _payloads(fleet: Fleet, event_type: str) -> list[dict]:
    with fleet.engine.connect() as conn:
        rows = conn.execute(select(ledger_events.c.payload).where(ledger_events.c.event_type == event_type)
                            .order_by(ledger_events.c.seq))
        return [orjson.loads(r.payload) for r in rows]


def assert_exact_balances(fleet: Fleet, customers: list[int]) -> None:
    """Each customer paid exactly its settlements; owners got 80% of each,
    the platform the rest; nothing is held; the books verify."""
    settled = fleet.settlements()
    for customer in customers:
        charged = sum(s["charge_nano_usd"] for s in settled if s["customer_account_id"] == customer)
        view = fleet.balance(customer)
        assert (view.balance_nano_usd, view.held_nano_usd) == (usd_to_nano_usd(CREDITS_USD) - charged, 0)
    with fleet.engine.connect() as conn:
        platform = acc.read_balance(conn, conn.execute(
            select(accounts.c.id).where(accounts.c.system_code == cmd.PLATFORM_REVENUE_ACCOUNT)).scalar_one())
    assert platform.balance_nano_usd == sum(s["charge_nano_usd"] - s["charge_nano_usd"] * 80 // 100 for s in settled)
    fleet.assert_books_close()


def assert_billed_at_the_bound(fleet: Fleet, contents: dict[str, str]) -> None:
    """Each request (by id) billed the proxy's prompt bound and the tokens it relayed."""
    by_id = {s["request_id"]: s for s in fleet.settlements()}
    for request_id, content in contents.items():
        meta = by_id[request_id]["meta"]
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (prompt_bound(content), MAX_TOKENS)
        assert by_id[request_id]["charge_nano_usd"] == (prompt_bound(content) * INPUT_NANO_USD_PER_TOKEN
                                                         + MAX_TOKENS * OUTPUT_NANO_USD_PER_TOKEN)


def test_prompt_inflation_on_one_account_is_recorded_and_never_a_strike(database_url):
    """What one caller sends can never get a worker struck: six inflated
    prompts of one account are six events, billed at the bound, no strike."""
    worker = rewriting_worker(lambda body: PROMPT_REPORTED_INFLATED)
    fleet = make_fleet(database_url, [worker.url])
    contents = {}
    with serving(database_url) as proxy:
        for i in range(6):
            response = chat(proxy, fleet.key, f"question {i} from one account")
            assert response.status_code == 200
            contents[response.json()["id"]] = f"question {i} from one account"
    worker.stop()
    recorded = discrepancies(fleet)
    # Recorded in the background after each answer: one per request, in no promised order.
    assert sorted((d["request_id"], d["customer_account_id"], d["reason"]) for d in recorded) == sorted(
        (request_id, fleet.customer_id, registry.PROMPT_ABOVE_BOUND) for request_id in contents)
    assert all(d["reported_prompt_tokens"] == PROMPT_REPORTED_INFLATED for d in recorded)
    stored = fleet.worker(fleet.worker_ids[0])
    assert (stored.state, stored.usage_strikes, stored.suspension_reason) == ("active", 0, None)
    assert_billed_at_the_bound(fleet, contents)
    assert_exact_balances(fleet, [fleet.customer_id])


def test_prompt_inflation_across_accounts_strikes_on_every_replica_and_suspends(database_url):
    """Evidence is read from the database: accounts served by two replicas
    add up. Each strike takes PROMPT_INFLATION_ACCOUNTS_MIN accounts' requests;
    the third suspends the worker with a WorkerSuspended event naming them."""
    worker = rewriting_worker(lambda body: PROMPT_REPORTED_INFLATED)
    fleet = make_fleet(database_url, [worker.url])
    per_strike = limits.PROMPT_INFLATION_ACCOUNTS_MIN
    customers = more_customers(fleet, per_strike * limits.USAGE_STRIKES_MAX - 1)
    contents = {}
    # What the strike count must reach after each request. The first account's
    # two requests count once towards the first strike; its second request is
    # that account's piece of the next one (a strike takes one per account).
    expected = [0, 0, 0, 1, 1, 2, 2, 2, 3]
    assert per_strike == 3 and len(expected) == len(customers) + 1
    with serving(database_url) as a, serving(database_url) as b:
        # The first account asks on both replicas: the same account twice does not count twice.
        asking = [(customers[0][1], a), *((key, (b, a)[n % 2]) for n, (_, key) in enumerate(customers))]
        for n, (key, replica) in enumerate(asking):
            content = f"request {n} on replica {replica.port}"
            response = chat(replica, key, content)
            assert response.status_code == 200
            contents[response.json()["id"]] = content
            # Evidence is recorded just after the answer, off its path: wait for it, then check it is not more.
            wait_for(lambda: len(discrepancies(fleet)) == n + 1)
            assert fleet.worker(fleet.worker_ids[0]).usage_strikes == expected[n], f"after request {n}"
        for replica in (a, b):  # both stop routing to it once they read its state
            wait_until_unroutable(replica, fleet)
            refused = chat(replica, fleet.key, "after the suspension")
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker_available"
    worker.stop()
    stored = fleet.worker(fleet.worker_ids[0])
    assert (stored.state, stored.usage_strikes) == ("suspended", limits.USAGE_STRIKES_MAX)
    assert stored.suspended_at is not None and registry.PROMPT_ABOVE_BOUND in stored.suspension_reason
    [suspended] = _payloads(fleet, "WorkerSuspended")
    assert (suspended["worker_id"], suspended["strikes"]) == (stored.id, limits.USAGE_STRIKES_MAX)
    assert suspended["reason"] == stored.suspension_reason and sorted(suspended["request_ids"]) == sorted(contents)
    assert len(discrepancies(fleet)) == len(contents)
    assert_billed_at_the_bound(fleet, contents)
    assert_exact_balances(fleet, [fleet.customer_id, *(c for c, _ in customers)])


def test_more_completion_than_relayed_is_proof_on_each_request(database_url):
    """One account is enough when the request itself proves it: the worker
    reports ten times the tokens the proxy relayed, above any byte-level count of them."""
    worker = ThreadedServer(build_app("instant", MODEL, inflate_usage=10)).start()
    fleet = make_fleet(database_url, [worker.url])
    contents = {}
    with serving(database_url) as proxy:
        for i in range(limits.USAGE_STRIKES_MAX):
            response = chat(proxy, fleet.key, f"inflated {i}")
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == MAX_TOKENS
            contents[response.json()["id"]] = f"inflated {i}"
        wait_until_unroutable(proxy, fleet)
        refused = chat(proxy, fleet.key, "after the suspension")
        assert refused.status_code == 503
    worker.stop()
    assert {d["reason"] for d in discrepancies(fleet)} == {metering.STRIKE_COMPLETION_ABOVE_BOUND}
    [suspended] = _payloads(fleet, "WorkerSuspended")
    assert sorted(suspended["request_ids"]) == sorted(contents)
    assert suspended["reason"] == f"{limits.USAGE_STRIKES_MAX} usage strikes: {metering.STRIKE_COMPLETION_ABOVE_BOUND}"
    settled = fleet.settlements()
    assert sorted(s["request_id"] for s in settled) == sorted(contents), "the refused request moved nothing"
    assert all(s["meta"]["completion_tokens"] == MAX_TOKENS for s in settled), "billed what was relayed"
    assert_exact_balances(fleet, [fleet.customer_id])


def wait_until_unroutable(proxy, fleet: Fleet) -> None:
    """The replica has read the worker's new state: a model with no live worker is not listed."""
    models = lambda: httpx.get(proxy.url + "/v1/models", headers={"authorization": f"Bearer {fleet.key}"}).json()
    wait_for(lambda: MODEL not in {entry["id"] for entry in models()["data"]})


def _discrepancy(worker_id: int, request_id: str, account: int, reason: str = registry.PROMPT_ABOVE_BOUND):
    return cmd.RecordUsageDiscrepancy(request_id, worker_id, 900, 4, 40, 4, f"usage-discrepancy:{request_id}", account, reason)


def test_evidence_counts_once_within_its_window_and_recording_again_changes_nothing(engine):
    with engine.begin() as conn:
        owner = acc.create_account(conn, cmd.OWNER, "owner")
        worker_id = registry.add_worker(conn, owner, "http://127.0.0.1:1", MODEL)
    record = lambda d, proof=False: _in_transaction(engine, lambda conn: registry.record_usage_discrepancy(conn, d, proof=proof))
    assert record(_discrepancy(worker_id, "old-1", 101)) == (True, False, False)
    assert record(_discrepancy(worker_id, "old-2", 102)) == (True, False, False)
    with engine.begin() as conn:  # these two are older than the window: they no longer add up with new ones
        for request_id, recorded_at in conn.execute(select(usage_evidence.c.request_id, usage_evidence.c.recorded_at)).all():
            conn.execute(update(usage_evidence).where(usage_evidence.c.request_id == request_id).values(
                recorded_at=recorded_at - timedelta(seconds=limits.PROMPT_INFLATION_WINDOW_S + 1)))
    assert record(_discrepancy(worker_id, "new-1", 103)) == (True, False, False)
    assert record(_discrepancy(worker_id, "new-1", 103)) == (False, False, False), "the same request again"
    assert record(_discrepancy(worker_id, "new-2", 104, reason=registry.USAGE_ABOVE_BOUND_UNPROVEN)) == (True, False, False)
    assert record(_discrepancy(worker_id, "new-3", 104)) == (True, False, False)
    assert record(_discrepancy(worker_id, "new-4", 105)) == (True, True, False)
    assert record(_discrepancy(worker_id, "new-5", 101)) == (True, False, False), "evidence counts for one strike"
    assert record(_discrepancy(worker_id, "proof-1", 101, reason="completion_above_bound"), proof=True) == (True, True, False)
    assert record(_discrepancy(worker_id, "proof-2", 101, reason="completion_above_bound"), proof=True) == (True, True, True)
    with engine.connect() as conn:
        stored = registry.get_worker(conn, worker_id)
        recorded = conn.execute(select(ledger_events.c.event_type)).scalars().all()
    assert (stored.state, stored.usage_strikes) == ("suspended", 3)
    assert stored.suspension_reason == "3 usage strikes: completion_above_bound, prompt_above_bound"
    assert recorded.count("UsageDiscrepancyRecorded") == 9 and recorded.count("WorkerSuspended") == 1


def test_inflation_strikes_do_not_depend_on_the_order_settlements_are_recorded(engine):
    """Three inflated requests from each of three accounts are three strikes,
    whichever order their settlements reach the database in: a strike takes
    one piece of evidence per account, never a fourth that arrived early."""
    with engine.begin() as conn:
        owner = acc.create_account(conn, cmd.OWNER, "owner")
        worker_id = registry.add_worker(conn, owner, "http://127.0.0.1:1", MODEL)
    record = lambda d: _in_transaction(engine, lambda conn: registry.record_usage_discrepancy(conn, d, proof=False))
    arrival = [101, 102, 101, 103, 102, 103, 101, 102, 103]  # round two's first request lands before round one's last
    outcomes = [record(_discrepancy(worker_id, f"inflated-{n}", account)) for n, account in enumerate(arrival)]
    assert [struck for _, struck, _ in outcomes] == [False, False, False, True, False, True, False, False, True]
    with engine.connect() as conn:
        stored = registry.get_worker(conn, worker_id)
        states = conn.execute(select(usage_evidence.c.state)).scalars().all()
    assert (stored.state, stored.usage_strikes) == ("suspended", 3)
    assert states.count("struck") == 9


def suspend_by_proof(engine, worker_id: int, account_id: int) -> list[str]:
    """What the proxy records for a worker caught USAGE_STRIKES_MAX times: the request ids."""
    request_ids = [f"chatcmpl-proof-{worker_id}-{n}" for n in range(limits.USAGE_STRIKES_MAX)]
    for request_id in request_ids:
        with engine.begin() as conn:
            registry.record_usage_discrepancy(conn, _discrepancy(worker_id, request_id, account_id, metering.STRIKE_COMPLETION_ABOVE_BOUND),
                                              proof=True)
    return request_ids


def _in_transaction(engine, work):
    with engine.begin() as conn:
        return tuple(work(conn))


# --- 200 agent conversations through an honest worker -----------------------

AGENT_CONVERSATIONS = 200
AGENT_ACCOUNTS = 4  # more than PROMPT_INFLATION_ACCOUNTS_MIN: an honest worker must not look like inflation
AGENT_CONCURRENCY = 16
ENGINE_BYTES_PER_TOKEN = 4  # the simulated engine's tokenizer
ENGINE_TOKENS_PER_MESSAGE = 4

TOOLS = [
    {"type": "function", "function": {
        "name": "search_flights", "description": "Search flights between two airports on a date.",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"}, "date": {"type": "string", "format": "date"},
            "passengers": {"type": "integer", "minimum": 1}}, "required": ["origin", "destination", "date"]}}},
    {"type": "function", "function": {
        "name": "book_hotel", "description": "Book a hotel room.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "nights": {"type": "integer"},
                                                        "notes": {"type": "string"}}, "required": ["city", "nights"]}}},
]
ITINERARY_FORMAT = {"type": "json_schema", "json_schema": {"name": "itinerary", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["flight", "hotel", "total_usd"],
    "properties": {"flight": {"type": "string"}, "hotel": {"type": "string"}, "total_usd": {"type": "number"}}}}}


def engine_prompt_tokens(body: dict) -> int:
    """What an engine's chat template renders, counted as the simulated
    engine's tokenizer would: every content string and text part, names,
    tool-call ids, tool calls' names and arguments, and the tool and
    response-format definitions."""
    total = 0
    for message in body["messages"]:
        rendered = [message["role"], message.get("name") or "", message.get("tool_call_id") or ""]
        content = message.get("content")
        if isinstance(content, str):
            rendered.append(content)
        elif isinstance(content, list):
            rendered += [part["text"] for part in content if part.get("type") == "text"]
        for call in message.get("tool_calls") or []:
            rendered += [call["id"], call["function"]["name"], call["function"]["arguments"]]
        total += len("".join(rendered).encode()) // ENGINE_BYTES_PER_TOKEN + ENGINE_TOKENS_PER_MESSAGE
    for extra in ("tools", "response_format"):
        if body.get(extra) is not None:
            total += len(orjson.dumps(body[extra])) // ENGINE_BYTES_PER_TOKEN
    return total


def agent_turns(n: int, rng: random.Random) -> list[dict]:
    """Two requests of one conversation: the turn that gets the tool's reply,
    and the final one asking for structured output."""
    notes = " ".join(rng.choice(["window seat", "late checkout", "quiet room", "vegetarian", "near the station"])
                     for _ in range(rng.randint(20, 400)))  # arguments from about 300 bytes to 5 kB
    call_id = f"call_{n:04d}"
    arguments = orjson.dumps({"city": rng.choice(["Lisbon", "Kraków", "Ōsaka"]), "nights": rng.randint(1, 9), "notes": notes}).decode()
    history = [
        {"role": "system", "content": "You are a travel agent. Use the tools, then answer in the asked format."},
        {"role": "user", "content": [{"type": "text", "text": f"Trip {n}: book me a hotel."},
                                     {"type": "text", "text": "Keep it under budget."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "book_hotel", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": orjson.dumps({"booking": f"H-{n}", "total_usd": 412.5}).decode()},
    ]
    first = {"messages": history, "tools": TOOLS, "tool_choice": "auto"}
    final = {"messages": [*history, {"role": "assistant", "content": "Booked. Anything else?"},
                          {"role": "user", "name": "traveller", "content": "Give me the itinerary."}],
             "tools": TOOLS, "response_format": ITINERARY_FORMAT}
    return [first, final]


async def _converse(proxy_url: str, keys_by_account: list[str]) -> list[tuple[int, str, int]]:
    """Every conversation, AGENT_CONCURRENCY at a time: (account index, request id, completion tokens received)."""
    clients = [openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key=key, max_retries=0) for key in keys_by_account]
    limit = asyncio.Semaphore(AGENT_CONCURRENCY)
    rng = random.Random(10)
    plans = [(n, n % len(clients), agent_turns(n, rng), n % 2 == 0) for n in range(AGENT_CONVERSATIONS)]

    async def conversation(n: int, account: int, turns: list[dict], stream: bool):
        received = []
        async with limit:
            for turn in turns:
                try:
                    received.append((account, *await ask(clients[account], turn, stream)))
                except openai.APIStatusError as exc:
                    received.append((account, f"refused with {exc.status_code}", 0))
        return received

    async def ask(client: openai.AsyncOpenAI, turn: dict, stream: bool) -> tuple[str, int]:
        if stream:
            chunks = await client.chat.completions.create(
                model=MODEL, max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True}, **turn)
            request_id, tokens = None, 0
            async for chunk in chunks:
                request_id = chunk.id
                tokens += sum(1 for c in chunk.choices if c.delta.content)
            return request_id, tokens
        answer = await client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, **turn)
        return answer.id, len(answer.choices[0].message.content.split())

    try:
        results = await asyncio.gather(*(conversation(*plan) for plan in plans))
    finally:
        for client in clients:
            await client.close()
    return [turn for conversation in results for turn in conversation]


def test_200_agent_conversations_through_an_honest_worker_end_with_no_strike(postgres_url):
    """Tool calls, tool replies, text parts and structured output, from several
    accounts at once: an honest engine's prompt count is never above the
    proxy's bound, so there is no discrepancy, no strike, and each request is
    billed what the engine counted and what the caller received."""
    worker = rewriting_worker(engine_prompt_tokens, "h200", time_scale=50.0)
    fleet = make_fleet(postgres_url, [worker.url])
    customers = [(fleet.customer_id, fleet.key), *more_customers(fleet, AGENT_ACCOUNTS - 1)]
    with serving(postgres_url) as proxy:
        received = asyncio.run(_converse(proxy.url, [key for _, key in customers]))
    worker.stop()
    assert len(received) == 2 * AGENT_CONVERSATIONS
    assert discrepancies(fleet) == [], "an honest engine's count is never above the proxy's bound"
    stored = fleet.worker(fleet.worker_ids[0])
    assert (stored.state, stored.usage_strikes) == ("active", 0)
    assert not [r for r in received if r[1].startswith("refused")]
    by_id = {s["request_id"]: s for s in fleet.settlements()}
    assert len(by_id) == len(received)
    for account, request_id, tokens in received:
        settled = by_id[request_id]
        assert settled["customer_account_id"] == customers[account][0]
        assert settled["meta"]["completion_tokens"] == tokens == MAX_TOKENS, "billed what the caller received"
    assert_exact_balances(fleet, [c for c, _ in customers])
