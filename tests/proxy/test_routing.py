"""Routing, metering and prices: pure functions, no servers."""
from __future__ import annotations

from datetime import UTC, datetime

import pytest

from ledger.errors import InvalidAmount
from proxy import limits, metering, routing, tokenize
from proxy import workers as registry
from proxy.errors import ContextTooLong, InvalidRequest, NoWorkerAvailable
from proxy.prices import Price, nano_usd_per_token


def _candidates(*weights, capacity=8, busy=None):
    busy = busy or [0] * len(weights)
    return [routing.Candidate(i + 1, float(w), capacity, b) for i, (w, b) in enumerate(zip(weights, busy))]


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
    first = preferred[0].worker_id
    busy = [routing.Candidate(c.worker_id, c.weight, 8, 8 if c.worker_id == first else 0) for c in idle]
    spilled = routing.choose(key, busy)
    assert spilled[0].worker_id == preferred[1].worker_id and spilled[-1].worker_id == first
    all_busy = [routing.Candidate(c.worker_id, c.weight, 8, 9 + c.worker_id) for c in idle]
    assert routing.choose(key, all_busy)[0].worker_id == 1, "everyone full: the least loaded first"


def test_a_new_worker_is_probed_at_the_fleets_median_weight():
    weights = routing.weights({1: 435, 2: 1342, 3: None})
    assert weights[3] == (888.5, limits.PROBE_CAPACITY_REQUESTS)
    assert weights[2] == (1342.0, 1342 // limits.TOKENS_PER_S_PER_REQUEST_MIN)
    assert routing.weights({7: None})[7][0] == limits.PROBE_WEIGHT_TOKENS_PER_S


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
            throughput_tokens_per_s: int | None = None) -> registry.WorkerView:
    return registry.WorkerView(worker_id, 100 + worker_id, f"http://127.0.0.1:{8000 + worker_id}", "m", "vllm", state,
                               context_length, None, healthy, throughput_tokens_per_s, datetime.now(UTC), None, None, 0,
                               None, None)


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
    fleet = [_worker(i, throughput_tokens_per_s=1000) for i in (1, 2, 3)]
    measured = {w.id: w.throughput_tokens_per_s for w in fleet}
    key = routing.affinity_key("m", {"messages": [{"role": "user", "content": "hello"}]})
    idle = routing.order(key, fleet, measured, {1: 0, 2: 0, 3: 0})
    assert routing.order(key, list(reversed(fleet)), measured, {1: 0, 2: 0, 3: 0}) == idle, "every replica agrees"
    capacity = 1000 // limits.TOKENS_PER_S_PER_REQUEST_MIN
    busy = routing.order(key, fleet, measured, {idle[0].id: capacity, idle[1].id: 0, idle[2].id: 0})
    assert [w.id for w in busy] == [idle[1].id, idle[2].id, idle[0].id]


def test_an_unmeasured_worker_is_probed_with_the_probe_capacity():
    fleet = [_worker(1), _worker(2, throughput_tokens_per_s=2000)]
    measured = {1: None, 2: 2000}
    key = next(k for k in (routing.affinity_key("m", {"prompt": f"p{i}"}) for i in range(100))
               if routing.order(k, fleet, measured, {1: 0, 2: 0})[0].id == 1)
    below, full = limits.PROBE_CAPACITY_REQUESTS - 1, limits.PROBE_CAPACITY_REQUESTS
    assert routing.order(key, fleet, measured, {1: below, 2: 0})[0].id == 1
    assert routing.order(key, fleet, measured, {1: full, 2: 0})[0].id == 2


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
