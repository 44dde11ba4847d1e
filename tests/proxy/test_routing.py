"""Routing, metering and prices: pure functions, no servers."""
from __future__ import annotations

import pytest

from ledger.errors import InvalidAmount
from proxy import metering, routing
from proxy.errors import InvalidRequest
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
    assert weights[3] == (888.5, routing.PROBE_CAPACITY_REQUESTS)
    assert weights[2] == (1342.0, 1342 // routing.TOKENS_PER_S_PER_REQUEST_MIN)
    assert routing.weights({7: None})[7][0] == routing.PROBE_WEIGHT_TOKENS_PER_S


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
