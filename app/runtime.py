"""Process-wide settings for long-running Paralon processes."""
from __future__ import annotations

import asyncio
import gc
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

# Why these thresholds: app/limits.py.
from app.limits import GC_GEN0_THRESHOLD_ALLOCATIONS, GC_GEN1_THRESHOLD_COLLECTIONS, GC_GEN2_THRESHOLD_COLLECTIONS

T = TypeVar("T")


def tune_garbage_collector() -> None:
    """Call once, after start-up has imported and built what lives for the whole process."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD_ALLOCATIONS, GC_GEN1_THRESHOLD_COLLECTIONS, GC_GEN2_THRESHOLD_COLLECTIONS)


def event_loop_name() -> str:
    """uvicorn's name for the fastest event loop installed."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run_on_service_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the event loop `paralon serve` runs on (uvloop when installed),
    for a process that stands in for a replica (a benchmark's callers)."""
    if event_loop_name() == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)
