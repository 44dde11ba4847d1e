"""The simulated GPU's parts, without a server: slots and the prefix cache."""
from __future__ import annotations

import asyncio

from proxy.limits import SIM_PREFIX_BLOCK_BYTES
from proxy.sim.engine import PrefixCache, SlotQueue


def test_requests_beyond_max_num_seqs_wait_in_arrival_order() -> None:
    async def scenario() -> list[object]:
        loop = asyncio.get_running_loop()
        slots = SlotQueue(max_running=1)
        assert slots.try_acquire()
        assert not slots.try_acquire()
        first, second = slots.enqueue(loop), slots.enqueue(loop)
        first.set_result(False)  # its client left while waiting
        slots.release()
        return [first.result(), second.done() and second.result(), slots.running]

    assert asyncio.run(scenario()) == [False, True, 1]


def test_a_request_the_kv_cache_cannot_hold_next_to_the_running_ones_waits_and_holds_back_those_behind_it() -> None:
    async def scenario() -> list[object]:
        loop = asyncio.get_running_loop()
        slots = SlotQueue(max_running=8, kv_capacity_tokens=100_000)
        assert slots.try_acquire(60_000)
        assert not slots.try_acquire(50_000), "the cache holds 40,000 more"
        long_prompt, chat = slots.enqueue(loop, 50_000), slots.enqueue(loop, 100)
        assert not slots.try_acquire(100), "nobody overtakes a waiting request"
        slots.release(60_000)
        admitted = [long_prompt.done(), chat.done(), slots.running, slots.kv_reserved_tokens]
        lone = SlotQueue(max_running=8, kv_capacity_tokens=10)
        return admitted + [lone.try_acquire(500)]

    assert asyncio.run(scenario()) == [True, True, 2, 50_100, True], "a request alone always runs"


def test_the_prefix_cache_holds_whole_blocks_and_forgets_the_least_recent():
    cache = PrefixCache(max_blocks=4)
    first = b"a" * (3 * SIM_PREFIX_BLOCK_BYTES + 10)
    assert cache.cached_bytes(first) == 0
    cache.insert(first)
    assert cache.cached_bytes(first) == 3 * SIM_PREFIX_BLOCK_BYTES, "only whole blocks"
    follow_up = first + b"b" * SIM_PREFIX_BLOCK_BYTES
    assert cache.cached_bytes(follow_up) == 3 * SIM_PREFIX_BLOCK_BYTES, "the shared prefix"
    cache.insert(b"c" * (4 * SIM_PREFIX_BLOCK_BYTES))
    assert cache.cached_bytes(first) == 0, "evicted by four newer blocks"
