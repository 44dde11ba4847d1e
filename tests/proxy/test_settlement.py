"""Settlement without servers: a `Generation` fed chunks by hand, settled by
the `Settler` into the real ledger on SQLite. The charge, the owner's share,
the release of the rest, discrepancies and strikes, a hold the sweeper took,
a ledger that is away."""
from __future__ import annotations

import asyncio
from datetime import timedelta

import orjson
import pytest
from sqlalchemy import select

from app.migrate import migrate
from ledger import accounts as acc
from ledger import commands as cmd
from ledger import holds as hl
from ledger.db import make_engine
from ledger.holds import PlaceHold, settlement_key
from ledger.schema import ledger_events, utc_now
from ledger.service import Ledger, append_now
from ledger.store import append_batch
from proxy import metering
from proxy import workers as registry
from proxy.directory import Directory, WorkerLoad
from proxy.embeddings import HeldRequest
from proxy.generation import CHAT, Generation
from proxy.generations import rest_key
from proxy.keys import KeyGrant
from proxy.limits import HOLD_TTL_S_DEFAULT
from proxy.prices import Price
from proxy.schema import usage_evidence
from proxy.settlement import Settler, discrepancy_of, hold_key
from proxy.upstream import UpstreamPool

PRICE = Price(150, 600)
CREDITS_NANO_USD = 10**9
PROMPT_BOUND = 50
MAX_TOKENS = 100
OWNER_SHARE_PERCENT = 80  # DESIGN.md, Money: written out, not read from the code under test


class Books:
    """A customer with credits, an owner with a worker, the ledger, and a settler."""

    def __init__(self, database_path) -> None:
        self.engine = make_engine(f"sqlite:///{database_path}")
        migrate(self.engine)
        with self.engine.begin() as conn:
            self.customer = acc.create_account(conn, cmd.CUSTOMER, "customer")
            self.owner = acc.create_account(conn, cmd.OWNER, "owner")
            worker_id = registry.add_worker(conn, self.owner, "http://127.0.0.1:9", "m")
            self.worker = registry.get_worker(conn, worker_id)
        append_now(self.engine, cmd.GrantCredits(self.customer, CREDITS_NANO_USD, "credits", "grant:1"))
        self.ledger = Ledger(self.engine)
        self.directory = Directory(self.engine)
        self.load = self.directory.loads[worker_id] = WorkerLoad()
        self.settler = Settler(self.ledger, self.directory, UpstreamPool(), hold_ttl_s=HOLD_TTL_S_DEFAULT)
        self.requests = 0

    def close(self) -> None:
        self.ledger.close()
        self.engine.dispose()

    def open(self, *, streaming: bool = True, account_id: int | None = None) -> Generation:
        """A request whose hold is placed and whose worker is chosen, as the proxy leaves it."""
        self.requests += 1
        generation = Generation(
            kind=CHAT, request_id=f"chatcmpl-{self.requests}", model="m", price=PRICE,
            grant=KeyGrant(1, account_id or self.customer, None), prompt_bound=PROMPT_BOUND, max_tokens=MAX_TOKENS,
            wants_usage=True, wants_continuous_usage=False, started_at=utc_now(), streaming=streaming,
            settle=self.settler.settle)
        plan = metering.plan_hold(PRICE, PROMPT_BOUND, MAX_TOKENS)
        hold = self.ledger.place_hold(PlaceHold(generation.grant.account_id, plan.amount_nano_usd,
                                                hold_key(generation.request_id), HOLD_TTL_S_DEFAULT, plan.minimum_nano_usd))
        generation.accept_hold(hold.hold_id, hold.amount_nano_usd)
        self.settler.track(generation)
        generation.use_worker(self.worker, {"messages": []})
        self.load.in_flight += 1
        return generation

    def balance(self, account_id: int) -> acc.BalanceView:
        with self.engine.connect() as conn:
            return acc.read_balance(conn, account_id)

    def settlements(self) -> dict[str, dict]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(ledger_events.c.idempotency_key, ledger_events.c.payload)
                                .where(ledger_events.c.event_type == "RequestSettled"))
            return {row.idempotency_key: orjson.loads(row.payload) for row in rows}

    def evidence(self) -> list[tuple[str, str]]:
        with self.engine.connect() as conn:
            return [(r.reason, r.state) for r in conn.execute(select(usage_evidence.c.reason, usage_evidence.c.state))]

    def sweep(self, after_s: int = HOLD_TTL_S_DEFAULT + 1) -> None:
        """What the sweeper does once the holds have expired."""
        later = utc_now() + timedelta(seconds=after_s)
        with self.engine.begin() as conn:
            hl.expire_holds(conn, now=later)
        with self.engine.begin() as conn:
            due = hl.expired_captures(conn, now=later)
            if due:
                append_batch(conn, due)


@pytest.fixture
def books(tmp_path):
    books = Books(tmp_path / "settlement.db")
    yield books
    books.close()


def relay(generation: Generation, tokens: int, *, finish: bool = True, usage: tuple[int, int] | None = None) -> None:
    """The worker's chunks, one word a token, then its usage report."""
    for _ in range(tokens):
        generation.transform(orjson.dumps({"choices": [{"index": 0, "delta": {"content": " word"}}]}))
    if finish:
        generation.transform(orjson.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    if usage is not None:
        generation.transform(orjson.dumps({"choices": [], "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]}}))


def settle(books: Books, generation: Generation, *, charge: bool = True) -> None:
    async def run() -> None:
        await generation.settle_once(charge=charge)
        await books.settler.drain_background()

    asyncio.run(run())


def test_a_request_is_charged_its_usage_and_the_owner_gets_80_percent(books):
    generation = books.open()
    relay(generation, 10, usage=(12, 10))
    settle(books, generation)
    charge = 12 * 150 + 10 * 600
    assert generation.cost_nano_usd == charge
    assert generation.usage == {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22}
    owner_share = charge * OWNER_SHARE_PERCENT // 100
    assert books.balance(books.owner).balance_nano_usd == owner_share
    customer = books.balance(books.customer)
    assert (customer.balance_nano_usd, customer.held_nano_usd) == (CREDITS_NANO_USD - charge, 0), "the rest is released"
    settled = books.settlements()[settlement_key(generation.request_id)]
    assert (settled["charge_nano_usd"], settled["owner_nano_usd"]) == (charge, owner_share)
    assert settled["meta"]["worker_id"] == books.worker.id and settled["meta"]["completion_tokens"] == 10
    assert books.evidence() == []
    assert (books.load.in_flight, books.load.relayed_tokens) == (0, 10)


def test_an_empty_completion_costs_nothing_and_releases_the_hold(books):
    generation = books.open()
    relay(generation, 0, usage=(12, 0))
    settle(books, generation)
    assert generation.cost_nano_usd == 0 and books.settlements() == {}
    assert books.balance(books.customer).available_nano_usd == CREDITS_NANO_USD


def test_settling_twice_settles_once(books):
    generation = books.open()
    relay(generation, 3, usage=(12, 3))

    async def run() -> None:
        first, second = generation.settle_once(), generation.settle_once(charge=False)
        assert first is second
        await first

    asyncio.run(run())
    assert len(books.settlements()) == 1


def test_an_abandoned_request_is_released_uncharged(books):
    generation = books.open(streaming=False)
    relay(generation, 5, finish=False)
    settle(books, generation, charge=False)
    assert books.settlements() == {} and books.load.in_flight == 0
    assert books.balance(books.customer).available_nano_usd == CREDITS_NANO_USD


def test_a_completion_reported_above_what_was_relayed_is_billed_at_the_bound_and_struck(books):
    generation = books.open()
    relay(generation, 10, usage=(12, 500))
    settle(books, generation)
    bound = generation.output.completion_bound()
    assert generation.usage["completion_tokens"] == bound < 500
    assert books.evidence() == [(metering.STRIKE_COMPLETION_ABOVE_BOUND, "struck")]
    assert books.balance(books.owner).balance_nano_usd == generation.cost_nano_usd * OWNER_SHARE_PERCENT // 100


def test_a_prompt_reported_above_its_bound_waits_for_other_accounts(books):
    generation = books.open()
    relay(generation, 10, usage=(PROMPT_BOUND + 1, 10))
    settle(books, generation)
    assert generation.usage["prompt_tokens"] == PROMPT_BOUND
    assert books.evidence() == [(registry.PROMPT_ABOVE_BOUND, "pending")]
    with books.engine.connect() as conn:
        assert registry.get_worker(conn, books.worker.id).usage_strikes == 0


def test_an_over_report_on_an_unfinished_answer_is_only_recorded(books):
    generation = books.open()
    relay(generation, 10, finish=False, usage=(12, 500))
    settle(books, generation)
    assert books.evidence() == [(registry.USAGE_ABOVE_BOUND_UNPROVEN, "cleared")]


@pytest.mark.parametrize(("usage", "finish", "reason", "proof"), [
    ((12, 500), True, metering.STRIKE_COMPLETION_ABOVE_BOUND, True),
    ((PROMPT_BOUND + 1, 10), True, registry.PROMPT_ABOVE_BOUND, False),
    ((12, 500), False, registry.USAGE_ABOVE_BOUND_UNPROVEN, False),
])
def test_the_discrepancy_recorded_and_whether_it_is_proof(books, usage, finish, reason, proof):
    generation = books.open()
    relay(generation, 10, finish=finish, usage=usage)
    billed = generation.delivered_usage()
    discrepancy, is_proof = discrepancy_of(generation, billed)
    assert (discrepancy.reason, is_proof) == (reason, proof)
    assert (discrepancy.reported_prompt_tokens, discrepancy.reported_completion_tokens) == usage
    assert (discrepancy.billed_prompt_tokens, discrepancy.billed_completion_tokens) == billed[:2]
    assert discrepancy.customer_account_id == books.customer


def test_what_the_sweeper_settled_is_not_charged_again_and_the_rest_is(books):
    """The hold was lost mid-stream (this process could not renew it): the
    sweeper settled the usage recorded so far; the rest is charged under a
    hold of its own, and the two add up to the whole."""
    generation = books.open()
    relay(generation, 4, finish=False, usage=(12, 4))
    books.ledger.renew_holds([books.settler.renewal(generation)])
    books.sweep()
    swept = books.settlements()[settlement_key(generation.request_id)]["charge_nano_usd"]
    assert swept == 12 * 150 + 4 * 600
    relay(generation, 6, usage=(12, 10))
    settle(books, generation)
    charge = 12 * 150 + 10 * 600
    settled = books.settlements()
    assert settled[rest_key(settlement_key(generation.request_id))]["charge_nano_usd"] == charge - swept
    assert generation.cost_nano_usd == charge
    assert books.balance(books.customer).balance_nano_usd == CREDITS_NANO_USD - charge
    assert books.balance(books.owner).balance_nano_usd == sum(s["owner_nano_usd"] for s in settled.values())


def test_a_renewal_records_what_a_stream_delivered_and_only_when_it_changed(books):
    generation = books.open()
    assert books.settler.renewal(generation).capture_nano_usd == 0, "nothing delivered yet"
    relay(generation, 4, finish=False, usage=(12, 4))
    renewal = books.settler.renewal(generation)
    assert renewal.capture_nano_usd == 12 * 150 + 4 * 600 and renewal.owner_account_id == books.owner
    assert books.settler.renewal(generation).capture_nano_usd == 0, "unchanged: the hold is only renewed"


def test_a_hold_the_sweeper_took_stops_the_stream_at_the_next_renewal(books):
    generation = books.open()
    relay(generation, 4, finish=False, usage=(12, 4))
    books.sweep()
    asyncio.run(books.settler.renew_holds_once())
    assert generation.hold_lost and not generation.finished


def test_a_request_settled_while_its_renewal_was_on_its_way_has_not_lost_its_hold(books, monkeypatch):
    """The renewal finds the hold gone because the request closed it by
    settling (its answer not yet given): the answer is whole, where a Responses
    answer said `incomplete`, and the charge is the whole usage, once."""
    generation = books.open()
    relay(generation, 4, usage=(12, 4))
    renew_holds, settle_delivered = books.ledger.renew_holds, books.settler._settle_delivered

    async def run() -> None:
        loop, written, answer = asyncio.get_running_loop(), asyncio.Event(), asyncio.Event()

        async def settle_then_wait(*args) -> None:  # the settlement is durable; the answer is not given yet
            await settle_delivered(*args)
            written.set()
            await answer.wait()

        def settle_first(renewals):  # in the renewal's thread, once the request was seen running
            asyncio.run_coroutine_threadsafe(_started(generation.settle_once, written), loop).result()
            return renew_holds(renewals)

        monkeypatch.setattr(books.settler, "_settle_delivered", settle_then_wait)
        monkeypatch.setattr(books.ledger, "renew_holds", settle_first)
        await books.settler.renew_holds_once()
        answer.set()
        await books.settler.drain_background()

    asyncio.run(run())
    assert generation.finished and not generation.hold_lost
    charge = 12 * 150 + 4 * 600
    assert [s["charge_nano_usd"] for s in books.settlements().values()] == [charge]
    assert books.balance(books.customer).balance_nano_usd == CREDITS_NANO_USD - charge


async def _started(settle_once, written: asyncio.Event) -> None:
    settle_once(charge=True)
    await written.wait()


def test_a_non_streaming_caller_has_received_nothing_until_the_end(books):
    generation = books.open(streaming=False)
    relay(generation, 4, finish=False, usage=(12, 4))
    assert books.settler.renewal(generation).capture_nano_usd == 0


class LedgerAway(Exception):
    pass


def _ledger_away(*args, **kwargs):
    raise LedgerAway("the database is away")


def test_a_streamed_answer_that_cannot_be_settled_now_is_settled_by_the_sweeper(books, monkeypatch):
    generation = books.open()
    relay(generation, 10, usage=(12, 10))
    monkeypatch.setattr(books.ledger, "append_async", _ledger_away)
    settle(books, generation)
    assert books.settlements() == {}
    books.sweep()
    charge = 12 * 150 + 10 * 600
    assert books.settlements()[settlement_key(generation.request_id)]["charge_nano_usd"] == charge
    assert books.balance(books.customer).balance_nano_usd == CREDITS_NANO_USD - charge


def test_a_non_streamed_answer_that_cannot_be_settled_is_withheld_and_nothing_charged(books, monkeypatch):
    generation = books.open(streaming=False)
    relay(generation, 10, usage=(12, 10))
    monkeypatch.setattr(books.ledger, "append_async", _ledger_away)
    settle(books, generation)
    assert generation.settle_failed and generation.cost_nano_usd == 0
    books.sweep()
    assert books.settlements() == {}
    assert books.balance(books.customer).available_nano_usd == CREDITS_NANO_USD


def test_an_embeddings_settlement_that_cannot_be_written_releases_its_hold(books):
    """An embedding request is no Generation (proxy.embeddings.HeldRequest):
    its answer is withheld and its own hold released, nothing charged."""
    hold = books.ledger.place_hold(PlaceHold(books.customer, 10_000, hold_key("emb-1"), HOLD_TTL_S_DEFAULT))
    held = HeldRequest(hold.hold_id, "emb-1")
    asyncio.run(books.settler._settle_later(held, None, database_away=False))
    view = books.balance(books.customer)
    assert held.withheld and (view.held_nano_usd, view.balance_nano_usd) == (0, CREDITS_NANO_USD)


def test_an_embedding_in_flight_does_not_stop_the_renewal_of_other_holds(books):
    """Renewals book each request's relayed tokens; an embedding request has
    no worker to book them for, and the round went on to renew the chat's hold."""
    chat = books.open()
    embedding = books.ledger.place_hold(PlaceHold(books.customer, 10_000, hold_key("emb-2"), HOLD_TTL_S_DEFAULT))
    books.settler.track(HeldRequest(embedding.hold_id, "emb-2"))
    renewed: list = []
    real_renew = books.ledger.renew_holds

    def watched(renewals):
        renewed.extend(r.hold_id for r in renewals)
        return real_renew(renewals)

    books.ledger.renew_holds = watched
    asyncio.run(books.settler.renew_holds_once())
    assert set(renewed) == {chat.hold_id, embedding.hold_id}
