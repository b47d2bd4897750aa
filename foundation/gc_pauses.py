"""Python's garbage collector as a cause of stalls: its pauses timed, and the start-up heap frozen.

A collection of the oldest generation walks every tracked object of the process: after start-up that
is the model's modules, the tokenizer, the server's routes and every live request's token lists, and
one walk can hold the GIL for tens of milliseconds. Every stream of the replica then waits, though the
GPU is idle. Two things here:

- `GcPauses` records each collection's end, length and generation (gc.callbacks), so a slow step can
  say how much of its time the collector took (`SlowSteps` does);
- `freeze_startup_heap` collects once and moves every object alive after start-up into the permanent
  generation (`gc.freeze`), so later collections walk only what serving allocated. It is skipped with
  DFLASH_GC_FREEZE=0 (to measure what it saves). Frozen objects in reference cycles are never
  collected, so whatever replaces start-up objects (a restarted pool's rebind, a drafter's re-attach)
  calls it again: it thaws the heap first, so what was replaced is collected, then freezes the rest;
  and what closes for good (a replica) thaws it (`thaw_heap`), so what it held can be collected.
"""

from __future__ import annotations

import atexit
import collections
import gc
import logging
import time

from foundation.environment import env_switch

logger = logging.getLogger(__name__)

FREEZE_VARIABLE = "DFLASH_GC_FREEZE"
KEPT = 256  # the latest collections remembered: far more than one step ever holds


class GcPauses:
    """The latest collections of this process, timed. One instance per process (`GcPauses.shared()`)."""

    _shared: GcPauses | None = None

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._started: float | None = None
        self._done: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=KEPT)

    @classmethod
    def shared(cls) -> GcPauses:
        """This process's watcher, installed in gc.callbacks the first time it is asked for."""
        if cls._shared is None:
            cls._shared = cls()
            gc.callbacks.append(cls._shared.on_gc)
        return cls._shared

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self.clock()
        elif self._started is not None:
            now = self.clock()
            self._done.append((now, now - self._started, info.get("generation", -1)))
            self._started = None

    def recent(self) -> list[tuple[float, float, int]]:
        """The latest collections (at most KEPT), oldest first: (end on `clock`, seconds, generation)."""
        return list(self._done)

    def within(self, seconds: float) -> tuple[float, int]:
        """(seconds of collection, the oldest generation collected; -1: none) over the last `seconds`."""
        since = self.clock() - seconds
        recent = [(length, generation) for end, length, generation in self._done if end >= since]
        return sum(length for length, _ in recent), max((generation for _, generation in recent), default=-1)


def thaw_heap() -> None:
    """Back into the collected generations: what a closed replica froze is garbage once let go."""
    gc.unfreeze()


def freeze_startup_heap() -> int:
    """Thaw, collect, then freeze what is left (unless DFLASH_GC_FREEZE=0); returns the objects frozen."""
    if not env_switch(FREEZE_VARIABLE):
        return 0
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)  # at exit the interpreter finalises what it can reach (no "leaked" reports)
    frozen = gc.get_freeze_count()
    logger.info("garbage collector: %d start-up objects frozen in %.2f s", frozen,
                time.perf_counter() - started)
    return frozen
