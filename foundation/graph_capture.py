"""A CUDA graph capture with Python's garbage collector held off.

A capture is invalidated by any CUDA call the capturing stream may not make, from any thread. The
collector runs whenever allocations pass its threshold, and a cycle it frees may hold an earlier
engine's `CUDAGraph`, whose destructor resets the graph (not permitted while a capture is open): the
capture fails with "operation failed due to a previous error during capture" in whatever kernel
launches next. Seen on the H200 in one GPU test run of two, each time in another test; in the runs
since this guard, not once. A deliberate reproduction (an old graph's cycle freed inside a capture)
did not fail on the H200, so the mechanism above is the likely one, not a proven one. Garbage is
collected before the capture and the collector is off during it either way.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_held() -> Iterator[None]:
    """Collect now, then keep the collector off until the block ends (restored as it was)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
