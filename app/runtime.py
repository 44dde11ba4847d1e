"""Process-wide settings for long-running Paralon processes."""
from __future__ import annotations

import gc

# A group-commit batch allocates hundreds of thousands of short-lived objects.
# With CPython's default gen0 threshold (700 allocations) that sets off
# collections all through every batch, and the older generations keep walking
# every long-lived object (SQLAlchemy metadata, statement caches). Freezing
# what start-up built and collecting less often cut the CPU per settlement by
# about a quarter in benchmarks/ledger_throughput.py.
GC_GEN0_THRESHOLD_ALLOCATIONS = 100_000
GC_GEN1_THRESHOLD_COLLECTIONS = 50
GC_GEN2_THRESHOLD_COLLECTIONS = 50


def tune_garbage_collector() -> None:
    """Call once, after start-up has imported and built what lives for the whole process."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD_ALLOCATIONS, GC_GEN1_THRESHOLD_COLLECTIONS, GC_GEN2_THRESHOLD_COLLECTIONS)

