"""Process-wide settings for long-running Paralon processes."""
from __future__ import annotations

import gc

# Why these thresholds: app/limits.py.
from app.limits import GC_GEN0_THRESHOLD_ALLOCATIONS, GC_GEN1_THRESHOLD_COLLECTIONS, GC_GEN2_THRESHOLD_COLLECTIONS


def tune_garbage_collector() -> None:
    """Call once, after start-up has imported and built what lives for the whole process."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD_ALLOCATIONS, GC_GEN1_THRESHOLD_COLLECTIONS, GC_GEN2_THRESHOLD_COLLECTIONS)

