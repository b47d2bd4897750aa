"""StepClock: how long a step of a given kind takes on this machine, learned online.

Both speculation choices weigh tokens per second, not tokens per step. The hybrid proposer asks
what a step costs with the DFlash drafter and without it (where the drafter costs as much as the
verify, a lookup that accepts a little less still emits more per second); adaptive speculation asks
what it costs to verify k drafts per row. What a step costs depends on the machine, the batch and
the context, so it is measured rather than modelled: an interval is filed under its kind (whether
the drafter ran; the k verified) and the batch's size rounded up to a power of two. The estimate is
the median of the latest `WINDOW` intervals, so one disturbed step (other work on the host, a
garbage collection) moves it little.

Intervals are measured by the engine, from one step's read to the next's, and only for steps that
decoded and followed the one before without an idle gap (`record`): an interval that spans the time
between two requests, or a prefill's, is not what a decode step of its kind costs. `intervals` hands
out the window itself, for a caller that must also know how many intervals an estimate rests on
(adaptive speculation: one slow first interval must not decide).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable

WINDOW = 15  # intervals kept per (kind, batch size)


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
