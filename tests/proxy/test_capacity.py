"""A worker's capacity: measured from what it delivered (its own counters),
smoothed, raised but never erased by quiet periods, and written once per
period by one replica so that every replica routes on the same weights."""
from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import httpx
from sqlalchemy import update
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.http.status import CAPACITY_METRIC, RoutingState
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.money import PERCENT
from ledger.schema import utc_now
from proxy import routing
from proxy.limits import DIRECTORY_REFRESH_INTERVAL_S, RELAYED_TOKENS_MARGIN_PERCENT
from proxy import workers as registry
from proxy.capacity import Capacity, Observation, Scrape, WorkerMetrics, next_capacity, observe
from proxy.directory import Directory, WorkerLoad
from proxy.schema import workers
from proxy.sim.profiles import get_profile
from tests.proxy.test_routing import _worker
from tests.support.harness import MODEL, make_fleet, serving, sim_worker, wait_for

# --- one period's measurement ---------------------------------------------------------


def _scrapes(*points: tuple[float, float, int, int]) -> list[Scrape]:
    """(time, tokens, running, waiting): an honest worker, whose count is what the proxies relayed."""
    return [Scrape(at_s, tokens, tokens, running, waiting) for at_s, tokens, running, waiting in points]


def test_a_period_spent_queueing_measures_the_capacity_and_the_batch():
    seen = observe(_scrapes((0, 0, 32, 5), (2, 870, 32, 7), (4, 1740, 32, 6), (6, 2610, 32, 9)))
    assert seen == Observation(435.0, True, 32)


def test_a_period_without_a_queue_is_only_a_floor():
    seen = observe(_scrapes((0, 0, 4, 0), (2, 300, 4, 0), (4, 600, 4, 1), (6, 900, 4, 0)))
    assert seen == Observation(150.0, False, None)


def test_a_short_burst_of_queueing_does_not_count_as_saturation():
    """Queued at both ends of one interval in three: the period's rate, not the burst's, and only a floor."""
    seen = observe(_scrapes((0, 0, 1, 0), (2, 100, 8, 3), (4, 900, 8, 2), (6, 1000, 1, 0)))
    assert seen == Observation(1000 / 6, False, None)


def test_a_single_scrape_measures_nothing_and_a_restarted_worker_is_measured_by_what_was_relayed():
    assert observe(_scrapes((0, 0, 1, 0))) is None
    restarted = [Scrape(0, 5000, 100, 1, 0), Scrape(2, 10, 300, 1, 0)]
    assert observe(restarted) == Observation(100.0, False, None)


def test_a_worker_inflating_its_own_counter_is_believed_only_a_margin_above_what_was_relayed():
    inflated = [Scrape(0, 0, 0, 32, 5), Scrape(2, 87_000, 870, 32, 5), Scrape(4, 174_000, 1740, 32, 5)]
    seen = observe(inflated)
    assert seen.saturated and seen.tokens_per_s == 435 * (PERCENT + RELAYED_TOKENS_MARGIN_PERCENT) / PERCENT
    without_counter = [Scrape(0, None, 0, 2, 0), Scrape(2, None, 400, 2, 0)]
    assert observe(without_counter) == Observation(200.0, False, None), "llama-cpp-python: what the proxies relayed"


# --- from one measurement to the next ---------------------------------------------------


def test_the_first_saturated_measurement_is_the_capacity_and_later_ones_are_smoothed():
    unknown = Capacity(None, False, None)
    first = next_capacity(unknown, Observation(435.0, True, 32))
    assert first == Capacity(435, True, 32)
    assert next_capacity(first, Observation(236.0, True, 30)) == Capacity(335, True, 31), "half way: one odd period does not swing it"


def test_a_floor_only_raises_and_a_quiet_period_erases_nothing():
    measured = Capacity(1300, True, 64)
    assert next_capacity(measured, Observation(0.0, False, None)) is None, "a quiet period"
    assert next_capacity(measured, Observation(900.0, False, None)) is None, "below saturation it delivered less: nothing learnt"
    assert next_capacity(measured, Observation(1500.0, False, None)) == Capacity(1500, True, 64), "it did more without queueing"
    assert next_capacity(Capacity(None, False, None), Observation(80.4, False, None)) == Capacity(80, False, None)


# --- one writer per period --------------------------------------------------------------


def test_of_two_replicas_that_read_the_same_row_only_the_first_writes(registry_engine):
    with registry_engine.begin() as conn:
        owner = acc.create_account(conn, cmd.OWNER, "owner")
        worker_id = registry.add_worker(conn, owner, "http://127.0.0.1:9100", "m")
        read_by_both = registry.get_worker(conn, worker_id)
    now = utc_now()
    with registry_engine.begin() as conn:
        assert registry.record_capacity(conn, read_by_both, Capacity(435, True, 32), now)
    with registry_engine.begin() as conn:
        assert not registry.record_capacity(conn, read_by_both, Capacity(999, True, 99), now), "the other replica was first"
        stored = registry.get_worker(conn, worker_id)
    assert (stored.throughput_tokens_per_s, stored.capacity_saturated, stored.capacity_requests) == (435, True, 32)
    with registry_engine.begin() as conn:  # the next period, built on the row as stored
        assert registry.record_capacity(conn, stored, Capacity(400, True, 32), now + timedelta(seconds=10))


# --- two replicas and a saturated worker -------------------------------------------------

PERIOD_MS = 2000
CALLERS = 48  # more than the simulated RTX 4090 pair runs at once (32): it queues
ANSWER_TOKENS = 48


def _capacity_seen_by(proxy_url: str) -> dict[str, tuple[float, str]]:
    text = httpx.get(proxy_url + "/metrics", timeout=10).text
    return {sample.labels["worker_id"]: (sample.value, sample.labels["saturated"])
            for family in text_string_to_metric_families(text) if family.name == CAPACITY_METRIC
            for sample in family.samples}


def test_two_replicas_measure_a_saturated_worker_alike_and_write_once_per_period(database_url):
    """Callers of both replicas saturate one simulated pair of RTX 4090s (435
    tokens/s at its batch of 32). Both replicas come to route on the same
    measured capacity, near the profile's, and the stored value changes at
    most once per period, whichever replica writes it."""
    profile = get_profile("2x4090")
    sim = sim_worker("2x4090", time_scale=1.0, stop_after_tokens=ANSWER_TOKENS)
    fleet = make_fleet(database_url, [sim.url], credits_usd="1000")
    worker_id = fleet.worker_ids[0]
    stop, watcher_stop = threading.Event(), threading.Event()
    writes: list = []
    refused: list[str] = []  # answers other than 200: they stop the load, and the test fails with them

    def watch_writes() -> None:
        while not watcher_stop.is_set():
            measured_at = fleet.worker(worker_id).capacity_measured_at
            if measured_at is not None and (not writes or writes[-1] != measured_at):
                writes.append(measured_at)
            time.sleep(0.1)

    env = {"PARALON_CAPACITY_PERIOD_MS": str(PERIOD_MS), "PARALON_HEALTH_INTERVAL_MS": "200"}
    try:
        with serving(database_url, **env) as one, serving(database_url, **env) as two:
            watcher = threading.Thread(target=watch_writes, daemon=True)
            watcher.start()
            load = threading.Thread(target=lambda: asyncio.run(_saturate([one.url, two.url], fleet.key, stop, refused)), daemon=True)
            load.start()
            try:
                wait_for(lambda: refused or fleet.worker(worker_id).capacity_saturated, timeout_s=60)
                time.sleep(2 * PERIOD_MS / 1000)  # a few saturated periods, each written by one replica
            finally:
                stop.set()
                load.join(60)
            assert not refused, refused
            # Unsaturated periods only raise a capacity: it stays, and a refresh later both replicas have it.
            time.sleep(PERIOD_MS / 1000 + 2 * DIRECTORY_REFRESH_INTERVAL_S)
            seen = [_capacity_seen_by(p.url)[str(worker_id)] for p in (one, two)]
    finally:
        stop.set()
        watcher_stop.set()
        sim.stop()
    watcher.join(10)
    stored = fleet.worker(worker_id)
    assert seen[0] == seen[1] == (float(stored.throughput_tokens_per_s), "1"), f"both replicas route on one value: {seen}"
    assert 0.8 * profile.reference_total_tok_s <= stored.throughput_tokens_per_s <= 1.2 * profile.reference_total_tok_s
    assert stored.capacity_requests == profile.max_num_seqs, "the batch it ran while requests queued"
    gaps_s = [(b - a).total_seconds() for a, b in zip(writes, writes[1:])]
    assert all(gap >= PERIOD_MS / 1000 * 0.9 for gap in gaps_s), f"one write per period at most: {gaps_s}"


async def _saturate(proxy_urls: list[str], key: str, stop: threading.Event, refused: list[str]) -> None:
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": ANSWER_TOKENS}

    async def caller(index: int) -> None:
        async with httpx.AsyncClient(base_url=proxy_urls[index % len(proxy_urls)], headers=headers, timeout=120) as client:
            while not stop.is_set():
                response = await client.post("/v1/chat/completions", json=body)
                if response.status_code != 200:
                    refused.append(f"{response.status_code} {response.text}")
                    stop.set()

    await asyncio.gather(*(caller(i) for i in range(CALLERS)))


# --- spills, as /metrics shows them -------------------------------------------------------


def test_a_spill_is_counted_by_reason_and_shown_on_metrics():
    fleet = [_worker(i, throughput_tokens_per_s=1000, saturated=True, capacity_requests=50) for i in (1, 2, 3)]
    directory = Directory(engine=None)
    directory.fleet = {"m": fleet}
    key = routing.affinity_key("m", {"messages": [{"role": "user", "content": "hello"}]})
    first = directory.place("m", key, fleet, 0)[0]
    assert not directory.spills
    directory.load(first.id).scraped(WorkerMetrics(running=3, waiting=2), at_s=0.0)  # its queue grows
    assert directory.place("m", key, fleet, 0)[0].id != first.id
    assert directory.spills == {("m", routing.SPILL_QUEUE): 1}
    metrics = CollectorRegistry(auto_describe=False)
    metrics.register(RoutingState(directory))
    text = generate_latest(metrics).decode()
    assert 'paralon_route_spills_total{model="m",reason="queue"} 1.0' in text
    assert f'{CAPACITY_METRIC}{{saturated="1",worker_id="{first.id}"}} 1000.0' in text


def test_a_single_candidate_is_placed_as_the_full_ordering_places_it_whatever_its_load():
    """The directory skips loads and weights for one candidate: the ordering it skips agrees, spill and all."""
    worker = _worker(1, throughput_tokens_per_s=1000, saturated=True, capacity_requests=2)
    directory = Directory(engine=None)
    directory.fleet = {"m": [worker]}
    key = routing.affinity_key("m", {"messages": [{"role": "user", "content": "hello"}]})
    for metrics in (WorkerMetrics(), WorkerMetrics(running=2, waiting=5)):  # idle, then full with a queue
        directory.load(worker.id).scraped(metrics, at_s=0.0)
        full = routing.order(key, [worker], {worker.id: directory.load(worker.id).view()})
        assert directory.place("m", key, [worker], 0) == full.workers == [worker] and full.spill is None
    assert not directory.spills


def test_the_load_a_replica_sees_is_the_workers_report_moved_by_its_own_requests_since():
    load = WorkerLoad()
    load.in_flight = 2
    load.scraped(WorkerMetrics(running=10, waiting=0), at_s=0.0)  # 10 running, 2 of them this replica's
    load.in_flight += 3
    assert load.busy() == 13, "three more started here since the report"
    load.in_flight -= 5
    assert load.busy() == 8


def test_a_scrape_adds_what_this_replica_relayed_and_has_not_added_to_every_replicas_total():
    load = WorkerLoad()
    load.relayed_tokens, load.relayed_flushed = 3_000, 2_500
    load.scraped(WorkerMetrics(running=1, generation_tokens=9_000.0), at_s=0.0, relayed_by_all=7_000)
    load.scraped(WorkerMetrics(), at_s=1.0, answered=False)
    assert [(s.generation_tokens, s.relayed_tokens) for s in load.scrapes] == [(9_000.0, 7_500.0)], \
        "a probe that failed adds nothing"


# --- room kept for long prompts, on every replica ------------------------------------------


def test_room_kept_for_a_long_prompt_on_one_replica_is_kept_by_the_others(registry_engine):
    with registry_engine.begin() as conn:
        owner = acc.create_account(conn, cmd.OWNER, "owner")
        large = registry.add_worker(conn, owner, "http://127.0.0.1:9201", "m", context_length=262_144)
        small = [registry.add_worker(conn, owner, f"http://127.0.0.1:{9202 + i}", "m", context_length=32_768) for i in range(2)]
        conn.execute(update(workers).values(healthy=True, throughput_tokens_per_s=3000, capacity_saturated=True,
                                            capacity_requests=128))
    one, two = Directory(registry_engine), Directory(registry_engine)

    async def long_prompt_on_one() -> None:
        await one.refresh_async()
        fleet = one.fleet["m"]
        assert [w.id for w in one.place("m", b"k" * 16, [w for w in fleet if w.id == large], 180_000)] == [large]
        while one._writing_room:
            await asyncio.sleep(0.01)

    asyncio.run(long_prompt_on_one())
    asyncio.run(two.refresh_async())
    fleet = two.fleet["m"]
    stored = next(w for w in fleet if w.id == large)
    assert stored.long_prompts_until is not None and stored.long_prompts_until > utc_now()
    key = next(k for k in (routing.affinity_key("m", {"prompt": f"chat {i}"}) for i in range(1000))
               if two.place("m", k, fleet, 0)[0].id == large)
    two.load(large).in_flight = 100  # three quarters of its batch of 128, and more
    assert two.place("m", key, fleet, 0)[0].id in small, "the other replica leaves the large worker's room to long prompts"
    assert two.spills == {("m", routing.SPILL_RESERVED): 1}
