"""StepClock: how long a step takes on this machine with the DFlash drafter and without it, learned online.

The hybrid proposer weighs tokens per second, not tokens per step: where the drafter costs as much
as the verify (a small target, a CPU), a lookup that accepts a little less than DFlash still emits
more per second, since a step that drafts only by lookup skips the drafter. What a step costs
depends on the machine, the batch and the context, so it is measured rather than modelled: the wall
time from one `propose` to the next is the step in between (its drafting, verify and bookkeeping),
filed under whether the drafter ran and the batch's size (rounded up to a power of two). The
estimate is the median of the latest `WINDOW` such intervals, so an idle gap or a step that also
prefilled a long prompt moves it little.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

WINDOW = 15  # intervals kept per (drafter ran, batch size)


def batch_bucket(num_seqs: int) -> int:
    """The power of two at or above num_seqs: steps of nearby batch sizes cost alike."""
    return 1 << max(0, num_seqs - 1).bit_length()


class StepClock:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._intervals: dict[tuple[bool, int], deque[float]] = {}
        self._open: tuple[float, bool, int] | None = None  # the step since the last propose

    def step_begins(self, num_seqs: int, drafter_runs: bool) -> None:
        """A propose for `num_seqs` rows starts now: the step before it has ended."""
        now = self.clock()
        if self._open is not None:
            started, ran, bucket = self._open
            self._intervals.setdefault((ran, bucket), deque(maxlen=WINDOW)).append(now - started)
        self._open = (now, drafter_runs, batch_bucket(num_seqs))

    def estimate(self, num_seqs: int, drafter_runs: bool) -> float | None:
        """Seconds a step of this batch size takes (None: not measured yet)."""
        intervals = self._intervals.get((drafter_runs, batch_bucket(num_seqs)))
        return statistics.median(intervals) if intervals else None
