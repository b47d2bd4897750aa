"""StepClock: how long a step of a given kind takes on this machine, learned online.

Both speculation choices weigh tokens per second, not tokens per step. The hybrid proposer asks
what a step costs with the DFlash drafter and without it (where the drafter costs as much as the
verify, a lookup that accepts a little less still emits more per second); adaptive speculation asks
what it costs to verify k drafts per row. What a step costs depends on the machine, the batch and
the context, so it is measured rather than modelled: an interval is filed under its kind (whether
the drafter ran; the k verified) and the batch's size rounded up to a power of two. `estimate` is
the median of the latest `WINDOW` intervals; the choices weigh `step_seconds`, a low quantile of
them, and only once a kind has `SETTLED_INTERVALS` of them may its own time rule it out: one
disturbed step (other work on the host, a garbage collection, a first graph replay) moves either
little.

Intervals are measured by the engine, from one step's read to the next's, and only for steps that
decoded and followed the one before without an idle gap (`record`): an interval that spans the time
between two requests, or a prefill's, is not what a decode step of its kind costs. `intervals` hands
out the window itself, for a caller that must also know how many intervals an estimate rests on
(adaptive speculation: one slow first interval must not decide).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Sequence

WINDOW = 15  # intervals kept per (kind, batch size)
SETTLED_INTERVALS = 3  # intervals of a kind before its own time may rule it out
STEP_QUANTILE = 0.25  # of a kind's intervals: its time (low, as slow outliers are upward only)
EXPLORE_EVERY = 64  # choices at a batch size between two of the kind measured longest ago


def step_seconds(intervals: Sequence[float]) -> float | None:
    """A kind's time from its intervals: the order statistic of rank round(q (n + 1)), whose expected
    quantile is q whatever n, so kinds with few and many intervals compare alike; None without any.
    A slow interval (warm-up, a first graph replay, a GC pause) is an outlier upward only."""
    if not intervals:
        return None
    rank = min(len(intervals), max(1, round(STEP_QUANTILE * (len(intervals) + 1))))
    return sorted(intervals)[rank - 1]


def batch_bucket(num_seqs: int) -> int:
    """The power of two at or above num_seqs: steps of nearby batch sizes cost alike."""
    return 1 << max(0, num_seqs - 1).bit_length()


class StepClock:
    def __init__(self):
        self._intervals: dict[tuple[Hashable, int], deque[float]] = {}
        self._recorded_at: dict[tuple[Hashable, int], int] = {}  # key -> the serial of its latest interval
        self._serial = 0

    def record(self, num_seqs: int, kind: Hashable, seconds: float) -> None:
        key = (kind, batch_bucket(num_seqs))
        self._intervals.setdefault(key, deque(maxlen=WINDOW)).append(seconds)
        self._serial += 1
        self._recorded_at[key] = self._serial

    def estimate(self, num_seqs: int, kind: Hashable) -> float | None:
        """Seconds a step of this kind and batch size takes (None: not measured yet)."""
        intervals = self._intervals.get((kind, batch_bucket(num_seqs)))
        return statistics.median(intervals) if intervals else None

    def intervals(self, num_seqs: int, kind: Hashable) -> tuple[float, ...]:
        """The latest intervals of this kind and batch size, oldest first (at most WINDOW)."""
        return tuple(self._intervals.get((kind, batch_bucket(num_seqs)), ()))

    def last_recorded(self, num_seqs: int, kind: Hashable) -> int:
        """The serial of this key's latest interval (0: never): which measurement is the oldest."""
        return self._recorded_at.get((kind, batch_bucket(num_seqs)), 0)


class Exploration:
    """Every `every`-th choice at a batch size, the kind measured longest ago: a choice that weighs
    measured times takes it once, so a time it stopped measuring is corrected (one step in `every`
    may be off the best). Adaptive speculation and the hybrid proposer each keep one."""

    def __init__(self, clock: StepClock, every: int = EXPLORE_EVERY):
        self.clock, self.every = clock, every
        self._choices_at_bucket: dict[int, int] = {}

    def due(self, num_seqs: int, kinds: Sequence[Hashable]) -> Hashable | None:
        """Count a choice at this batch size; the kind to take instead on every every-th, else None."""
        bucket = batch_bucket(num_seqs)
        count = self._choices_at_bucket[bucket] = self._choices_at_bucket.get(bucket, 0) + 1
        if count % self.every:
            return None
        return min(kinds, key=lambda kind: self.clock.last_recorded(num_seqs, kind))
