"""Routing, metering and prices: pure functions, no servers."""
from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

import pytest

from ledger.errors import InvalidAmount
from proxy import limits, metering, routing, tokenize
from proxy import workers as registry
from proxy.errors import ContextTooLong, InvalidRequest, NoWorkerAvailable
from proxy.prices import Price, nano_usd_per_token


def _candidates(*weights, capacity=8, busy=None):
    busy = busy or [0] * len(weights)
    return [routing.Candidate(i + 1, float(w), capacity, capacity, b) for i, (w, b) in enumerate(zip(weights, busy))]


def test_a_follow_up_has_the_same_affinity_key_as_its_first_turn():
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is KV cache?"}]
    follow_up = first + [{"role": "assistant", "content": "A cache."}, {"role": "user", "content": "Say more."}]
    other = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Something else"}]
    key = routing.affinity_key("m", {"messages": first})
    assert routing.affinity_key("m", {"messages": follow_up}) == key
    assert routing.affinity_key("m", {"messages": other}) != key
    assert routing.affinity_key("other-model", {"messages": first}) != key


def test_rendezvous_ignores_candidate_order_and_moves_only_the_removed_workers_keys():
    workers = _candidates(100, 100, 100, 100)
    keys = [routing.affinity_key("m", {"prompt": f"conversation {i}"}) for i in range(2000)]
    chosen = {k: routing.rendezvous_order(k, workers)[0].worker_id for k in keys}
    assert all(routing.rendezvous_order(k, list(reversed(workers)))[0].worker_id == chosen[k] for k in keys)
    without_4 = [w for w in workers if w.worker_id != 4]
    moved = [k for k in keys if routing.rendezvous_order(k, without_4)[0].worker_id != chosen[k]]
    assert moved and all(chosen[k] == 4 for k in moved)


def test_rendezvous_shares_keys_in_proportion_to_measured_throughput():
    workers = _candidates(435, 1305)  # two RTX 4090s against three times their throughput
    keys = [routing.affinity_key("m", {"prompt": f"c{i}"}) for i in range(20_000)]
    share_fast = sum(routing.rendezvous_order(k, workers)[0].worker_id == 2 for k in keys) / len(keys)
    assert 0.72 < share_fast < 0.78


def test_a_busy_affinity_choice_spills_to_the_next_in_rendezvous_order():
    key = routing.affinity_key("m", {"prompt": "hello"})
    idle = _candidates(100, 100, 100)
    preferred = routing.choose(key, idle)
    assert preferred.spill is None
    first = preferred.order[0].worker_id
    busy = [routing.Candidate(c.worker_id, c.weight, 8, 8, 8 if c.worker_id == first else 0) for c in idle]
    spilled = routing.choose(key, busy)
    assert spilled.order[0].worker_id == preferred.order[1].worker_id and spilled.order[-1].worker_id == first
    assert spilled.spill == routing.SPILL_BUSY
    all_busy = [routing.Candidate(c.worker_id, c.weight, 8, 8, 9 + c.worker_id) for c in idle]
    assert routing.choose(key, all_busy).order[0].worker_id == 1, "everyone full: the least loaded first"


def test_a_worker_whose_queue_grows_is_spilled_off_even_below_its_batch():
    key = routing.affinity_key("m", {"prompt": "hello"})
    idle = _candidates(100, 100, 100)
    first = routing.choose(key, idle).order[0].worker_id
    queued = [routing.Candidate(c.worker_id, c.weight, 8, 8, 1, waiting=2 if c.worker_id == first else 0) for c in idle]
    placed = routing.choose(key, queued)
    assert placed.order[0].worker_id != first and placed.spill == routing.SPILL_QUEUE


def test_an_unmeasured_worker_keeps_its_conversations_until_its_queue_shows_or_a_generous_ceiling():
    """At start-up no worker is measured: a conversation stays on its
    rendezvous winner until the worker queues, or runs as many requests as
    would each decode at 5 tok/s of the probe weight (200), never at 8."""
    fleet = [_worker(i) for i in (1, 2, 3)]
    key = routing.affinity_key("m", {"prompt": "hello"})
    winner = routing.order(key, fleet, _loads(fleet)).workers[0].id
    ceiling = routing.weights(fleet)[winner].capacity_requests
    assert ceiling == routing.quantise_tokens_per_s(limits.PROBE_WEIGHT_TOKENS_PER_S) // limits.BATCH_TOKENS_PER_S_PER_REQUEST_MIN
    assert routing.order(key, fleet, _loads(fleet, {winner: ceiling - 1})) == (routing.order(key, fleet, _loads(fleet)).workers, None)
    assert routing.order(key, fleet, _loads(fleet, {winner: ceiling})).spill == routing.SPILL_BUSY


def test_a_quiet_fleets_floors_never_cut_an_unmeasured_worker_off_at_a_few_requests():
    quiet = [_worker(1, throughput_tokens_per_s=12), _worker(2, throughput_tokens_per_s=9)]
    assert all(size.capacity_requests == limits.PROBE_WEIGHT_TOKENS_PER_S // limits.BATCH_TOKENS_PER_S_PER_REQUEST_MIN
               for size in routing.weights(quiet).values())


def test_before_anything_is_measured_a_burst_is_shared_by_the_size_of_each_kv_cache():
    fleet = [_worker(1, context_length=262_144), _worker(2, context_length=65_536), _worker(3, context_length=131_072)]
    kv = {1: 1_500_000, 2: 150_000, 3: 300_000}
    loads = {w.id: routing.WorkerLoadView(0, 0, kv[w.id], kv[w.id]) for w in fleet}
    keys = [routing.affinity_key("m", {"prompt": f"burst {i}"}) for i in range(3000)]
    shares = Counter(routing.order(k, fleet, loads).workers[0].id for k in keys)
    assert shares[1] > 4 * shares[3] > 4 * shares[2] > 0, shares
    sizes = routing.weights(fleet, kv)
    assert sizes[1].weight > 8 * sizes[2].weight, "ten times the cache, about ten times the weight (in steps of 19%)"


def test_a_new_worker_is_probed_at_the_fleets_median_capacity():
    fleet = [_worker(1, throughput_tokens_per_s=435, saturated=True, capacity_requests=32),
             _worker(2, throughput_tokens_per_s=1342, saturated=True, capacity_requests=64), _worker(3)]
    sizes = routing.weights(fleet)
    assert sizes[3].weight == routing.quantise_tokens_per_s(888.5) and not sizes[3].batch_measured
    assert sizes[2] == routing.Size(routing.quantise_tokens_per_s(1342), 64, 64, True)
    assert routing.weights([_worker(7)])[7].weight == routing.quantise_tokens_per_s(limits.PROBE_WEIGHT_TOKENS_PER_S)


def test_a_batch_is_never_more_than_the_delivery_shows_at_the_slowest_acceptable_rate():
    claimed = [_worker(1, throughput_tokens_per_s=435, saturated=True, capacity_requests=10_000)]
    assert routing.weights(claimed)[1].capacity_requests == routing.quantise_tokens_per_s(435) // limits.BATCH_TOKENS_PER_S_PER_REQUEST_MIN
    honest = [_worker(1, throughput_tokens_per_s=3300, saturated=True, capacity_requests=256)]
    assert routing.weights(honest)[1].capacity_requests == 256, "an H200's batch is believed"


def test_a_floor_below_the_median_is_raised_to_it_until_the_worker_saturates():
    fleet = [_worker(1, throughput_tokens_per_s=1000, saturated=True, capacity_requests=50),
             _worker(2, throughput_tokens_per_s=40), _worker(3, throughput_tokens_per_s=3000)]
    sizes = routing.weights(fleet)
    assert sizes[2].weight == routing.quantise_tokens_per_s(1000), "a quiet worker is probed, not starved"
    assert sizes[3].weight == routing.quantise_tokens_per_s(3000), "a floor above the probe is its own"


def test_quantised_throughput_is_stable_under_small_differences():
    assert routing.quantise_tokens_per_s(1300) == routing.quantise_tokens_per_s(1320)
    assert routing.quantise_tokens_per_s(435) < routing.quantise_tokens_per_s(1300)


@pytest.mark.parametrize("value", [0, -1, "10", 1.5, 2_000_000])
def test_bad_max_tokens_are_refused(value):
    with pytest.raises(InvalidRequest):
        metering.requested_max_tokens("chat", {"max_tokens": value})


def test_a_hold_is_clamped_to_whole_tokens_of_what_was_granted():
    price = Price(150, 600)
    plan = metering.plan_hold(price, prompt_bound=100, max_tokens=1000)
    assert plan == (100 * 150 + 1000 * 600, 100 * 150 + 600)
    assert metering.affordable_max_tokens(price, 100, 100 * 150 + 600 * 7 + 599) == 7


def test_prices_per_million_tokens_are_whole_nano_usd_per_token():
    assert nano_usd_per_token("0.15") == 150 and nano_usd_per_token("0.150000") == 150
    assert nano_usd_per_token("3") == 3000 and nano_usd_per_token("0") == 0
    for bad in ("0.0001", "-1", "abc", "1e400", "0.1234567"):
        with pytest.raises(InvalidAmount):
            nano_usd_per_token(bad)
    assert Price(150, 600).charge_nano_usd(1000, 10) == 156_000


# --- candidates and the order to try them -------------------------------------


def _worker(worker_id: int, *, state: str = "active", healthy: bool = True, context_length: int | None = None,
            throughput_tokens_per_s: int | None = None, saturated: bool = False,
            capacity_requests: int | None = None) -> registry.WorkerView:
    return registry.WorkerView(worker_id, 100 + worker_id, f"http://127.0.0.1:{8000 + worker_id}", "m", "vllm", state,
                               context_length, None, healthy, throughput_tokens_per_s, datetime.now(UTC), None, None, 0,
                               None, None, capacity_saturated=saturated, capacity_requests=capacity_requests)


def _loads(fleet, busy=None, free_kv=None):
    busy, free_kv = busy or {}, free_kv or {}
    return {w.id: routing.WorkerLoadView(busy.get(w.id, 0), 0, free_kv.get(w.id)) for w in fleet}


def test_only_active_healthy_workers_whose_context_holds_the_request_are_candidates():
    fleet = [_worker(1), _worker(2, state="draining"), _worker(3, healthy=False), _worker(4, state="suspended"),
             _worker(5, context_length=1000), _worker(6, context_length=4000)]
    assert [w.id for w in routing.candidates(fleet, 2000)] == [1, 6]


def test_no_routable_worker_and_no_context_large_enough_are_refused_differently():
    with pytest.raises(NoWorkerAvailable):
        routing.candidates([_worker(1, state="drained"), _worker(2, healthy=False)], 10)
    with pytest.raises(ContextTooLong, match="maximum context length is 4000 tokens"):
        routing.candidates([_worker(1, context_length=1000), _worker(2, context_length=4000)], 5000)


def test_max_tokens_is_what_was_asked_within_the_room_every_known_context_leaves():
    assert metering.planned_max_tokens(100, 50, [1000, 2000]) == 100
    assert metering.planned_max_tokens(5000, 50, [1000, 2000]) == 1950, "clamped to the largest context's room"
    assert metering.planned_max_tokens(None, 50, [1000, 2000]) == 1950
    assert metering.planned_max_tokens(5000, 50, [1000, None]) == 5000, "a worker of unknown context may hold it"
    assert metering.planned_max_tokens(None, 50, [None]) == limits.MAX_TOKENS_WITHOUT_CONTEXT
    assert metering.planned_max_tokens(None, 5000, [1000]) == 1, "never less than one token"


def test_the_order_follows_affinity_and_spills_off_a_busy_worker():
    fleet = [_worker(i, throughput_tokens_per_s=1000, saturated=True, capacity_requests=50) for i in (1, 2, 3)]
    key = routing.affinity_key("m", {"messages": [{"role": "user", "content": "hello"}]})
    idle = routing.order(key, fleet, _loads(fleet)).workers
    assert routing.order(key, list(reversed(fleet)), _loads(fleet)).workers == idle, "every replica agrees"
    busy = routing.order(key, fleet, _loads(fleet, {idle[0].id: 50}))
    assert [w.id for w in busy.workers] == [idle[1].id, idle[2].id, idle[0].id] and busy.spill == routing.SPILL_BUSY


def test_a_long_prompt_goes_where_the_kv_cache_has_room_and_short_traffic_leaves_room_on_reserved_workers():
    fleet = [_worker(1, context_length=262_144, throughput_tokens_per_s=3000, saturated=True, capacity_requests=128),
             *(_worker(i, context_length=65_536, throughput_tokens_per_s=400, saturated=True, capacity_requests=32)
               for i in (2, 3, 4))]
    keys = [routing.affinity_key("m", {"prompt": f"document {i}"}) for i in range(400)]
    free = {1: 1_500_000, 2: 150_000, 3: 150_000, 4: 20_000}
    firsts = [routing.order(k, fleet, _loads(fleet, free_kv=free), needed_tokens=40_000).workers[0].id for k in keys]
    assert set(firsts) == {1, 2, 3}, "every worker with room takes some; worker 4 has too little KV left"
    assert firsts.count(1) > firsts.count(2), "in proportion to the room left after it"
    short = routing.affinity_key("m", {"prompt": next(f"chat {i}" for i in range(1000) if routing.order(
        routing.affinity_key("m", {"prompt": f"chat {i}"}), fleet, _loads(fleet)).workers[0].id == 1)})
    assert routing.order(short, fleet, _loads(fleet, {1: 95}), reserved=frozenset({1})).workers[0].id == 1
    kept = routing.order(short, fleet, _loads(fleet, {1: 96}), reserved=frozenset({1}))
    assert kept.workers[0].id != 1 and kept.spill == routing.SPILL_RESERVED, "a quarter of its batch of 128 stays free"
    assert routing.order(short, fleet, _loads(fleet, {1: 96})).workers[0].id == 1, "without a long prompt, no reserve"
    unmeasured = [_worker(w.id, context_length=w.context_length) for w in fleet]
    on_1 = next(k for k in (routing.affinity_key("m", {"prompt": f"chat {i}"}) for i in range(1000))
                if routing.order(k, unmeasured, _loads(unmeasured)).workers[0].id == 1)
    assert routing.order(on_1, unmeasured, _loads(unmeasured, {1: 150}), reserved=frozenset({1})).workers[0].id == 1, \
        "a worker whose batch is not known is not held back"


def test_a_worker_claiming_a_huge_kv_cache_is_believed_only_so_many_of_its_contexts():
    fleet = [_worker(1, context_length=65_536), _worker(2, context_length=65_536)]
    claims = {1: 10_000_000_000, 2: 150_000}
    weights = routing.long_prompt_weights(fleet, _loads(fleet, free_kv=claims), 40_000)
    assert weights == {1: 65_536 * limits.KV_CACHE_CONTEXTS_MAX - 40_000, 2: 110_000}


def test_the_baselines_spread_requests_without_affinity():
    fleet = [_worker(i) for i in (3, 1, 2)]
    assert [routing.baseline_order(routing.ROUND_ROBIN, fleet, turn)[0].id for turn in range(4)] == [1, 2, 3, 1]
    assert {routing.baseline_order(routing.RANDOM, fleet, 0)[0].id for _ in range(200)} == {1, 2, 3}


# --- long prompts: the count, the room per worker, the retry on a larger one ----


def test_a_prompt_is_counted_only_when_its_byte_bound_does_not_fit_every_routable_worker():
    fleet = [_worker(1, context_length=262_144), _worker(2, context_length=32_768), _worker(3)]
    assert routing.holds_everywhere(fleet, 32_768), "a worker of unknown context may hold it"
    assert not routing.holds_everywhere(fleet, 32_769)
    unhealthy_small = [_worker(1, context_length=262_144), _worker(2, context_length=32_768, healthy=False)]
    assert routing.holds_everywhere(unhealthy_small, 100_000), "only routable workers matter"


def test_a_too_long_refusal_is_retried_only_on_a_larger_context():
    assert routing.larger(_worker(1, context_length=262_144), 32_768)
    assert not routing.larger(_worker(2, context_length=32_768), 32_768)
    assert routing.larger(_worker(3), 32_768), "a worker of unknown context may hold it"
    assert routing.larger(_worker(2, context_length=32_768), None)


def test_each_worker_is_sent_at_most_the_room_its_own_context_leaves():
    assert routing.worker_max_tokens(200_000, 1_000, 262_144) == 200_000
    assert routing.worker_max_tokens(200_000, 1_000, 32_768) == 31_768
    assert routing.worker_max_tokens(200_000, 1_000, None) == 200_000
    assert routing.worker_max_tokens(16, 40_000, 32_768) == 1, "never less than one token"


def test_a_count_only_lowers_the_bound_by_its_margin_never_above_the_byte_bound():
    assert tokenize.bound_in_force(720_000, None) == 720_000
    assert tokenize.bound_in_force(720_000, 180_000) == 180_000 + 180_000 * limits.COUNTED_PROMPT_MARGIN_PERCENT // 100
    assert tokenize.bound_in_force(720_000, 10) == 10 + limits.COUNTED_PROMPT_MARGIN_TOKENS_MIN
    assert tokenize.bound_in_force(1_000, 5_000) == 1_000, "a count above the byte bound moves nothing"
    assert tokenize.bound_in_force(1_000, 0) == limits.COUNTED_PROMPT_MARGIN_TOKENS_MIN


def test_the_count_cache_key_is_what_the_template_renders():
    messages = [{"role": "user", "content": "a long document"}]
    key = tokenize.prompt_key("m", "chat", {"messages": messages, "temperature": 0.1})
    assert tokenize.prompt_key("m", "chat", {"messages": messages, "temperature": 0.9, "top_p": 1}) == key
    assert tokenize.prompt_key("m", "chat", {"messages": messages, "tools": [{"type": "function"}]}) != key
    assert tokenize.prompt_key("other", "chat", {"messages": messages}) != key
    assert tokenize.countable("chat", {"messages": messages})
    assert tokenize.countable("completions", {"prompt": ["text"]})
    assert not tokenize.countable("completions", {"prompt": [1, 2, 3]}), "token ids are their own count"
