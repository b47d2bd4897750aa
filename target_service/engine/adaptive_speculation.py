"""AdaptiveSpeculation: how many drafts a step verifies, chosen for the batch's tokens per second.

Each step the scheduler asks `choose` for one k for the whole step (a uniform step replays one CUDA
graph; a row's drafts past what it may count cost the same as the others). For each candidate k of
`choices` (the ones the graphs cover), the step's expected tokens are the sum over its rows of
1 + E_row[min(k, cap_row)]: the bonus token, plus the drafts accepted on average, from the row's own
`AcceptanceCurve` pulled toward the server's; its time is the step clock's estimate for (batch, k).
The k with the most tokens per second is taken (`best_k`). At batch 1 on a GPU the verify reads the
weights once whatever k, so k stays high; at a large batch the verify is compute-bound, and rows
unlikely to be accepted are no longer worth their cost.

Step times are measured, not modelled (`StepClock`). A k's time is a low quantile of its latest
intervals (`step_seconds`): a slow interval (warm-up, a first graph replay, a GC pause) is an
outlier upward only. A k not measured at a batch bucket yet, or measured fewer than
`SETTLED_INTERVALS` times, is weighed at the least it could cost given the others (`least_seconds`:
no less than a smaller k, no less than a larger one scaled by rows verified), or its own time if
that is lower; so each k is tried where it could win, and only a settled measurement rules it out.
Without that, one slow first interval of K at batch 1 (where every k costs alike) made K look
slower than k 3 and 7 and kept it out until the next exploration (bench/results/adaptive_h200.md).
Every `explore_every` steps at a bucket the candidate measured longest ago is taken once, so a stale
measurement is corrected (one step in explore_every may be off the best).

Lossless: verifying fewer drafts changes which drafts are checked, never what the target emits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from target_service.engine.acceptance_curve import AcceptanceCurve
from target_service.proposers.step_clock import (
    EXPLORE_EVERY,
    SETTLED_INTERVALS,
    Exploration,
    StepClock,
    step_seconds,
)

SERVER_HALF_LIFE = 2048.0  # verifies (rows x steps) over which the server's curve forgets half
REQUEST_HALF_LIFE = 64.0  # ... one request's
REQUEST_PRIOR_WEIGHT = 8.0  # trials of the server's curve that a request's own counts start from


def default_choices(num_speculative_tokens: int) -> tuple[int, ...]:
    """0 (no drafts: the drafter skipped), 2^i - 1 below K, and K: few enough that each gets its
    CUDA graphs, spread so a curve of any steepness has a near-best candidate."""
    found = {0, num_speculative_tokens}
    k = 1
    while k < num_speculative_tokens:
        found.add(k)
        k = 2 * k + 1
    return tuple(sorted(found))


@dataclass(frozen=True)
class RowOutlook:
    expected: Sequence[float]  # E[0..K]: drafts accepted on average when k are verified
    cap: int  # drafts that may count this step (the draft budget, the request's own limit)


def step_tokens(rows: Sequence[RowOutlook], k: int) -> float:
    """Tokens a step verifying k drafts per row emits on average."""
    return sum(1.0 + row.expected[min(k, row.cap)] for row in rows)


def best_k(rows: Sequence[RowOutlook], choices: Sequence[int],
           seconds: Callable[[int], float | None],
           settled: Callable[[int], bool] = lambda k: True) -> int:
    """The choice with the most expected tokens per second; without any time known, the largest.
    A k measured but not `settled` (too few intervals to rule it out) is weighed at the least it
    could cost, if lower than its own time. A tie keeps the larger k (no fewer tokens per step for
    the same time)."""
    known = {k: seconds(k) for k in choices}
    measured = {k: t for k, t in known.items() if t is not None and t > 0}
    if not measured:
        return max(choices)
    best, best_rate = None, -1.0
    for k in sorted(choices, reverse=True):
        rate = step_tokens(rows, k) / weighed_seconds(k, measured, settled(k))
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = k, rate
    return best


def weighed_seconds(k: int, measured: dict[int, float], settled: bool) -> float:
    """The time best_k weighs for k: its own once settled; before, the lower of its own (if any)
    and the least it could cost given the others, so an unlucky first interval cannot rule it out."""
    own = measured.get(k)
    if own is not None and settled:
        return own
    floor = least_seconds(k, {other: t for other, t in measured.items() if other != k})
    if floor is None:
        return own
    return floor if own is None else min(own, floor)


def least_seconds(k: int, others: dict[int, float]) -> float | None:
    """The least a step verifying k drafts per row could cost, given other k's times (None: none):
    no less than a smaller k's (more drafts never cost less), no less than a larger k''s scaled by
    rows (k + 1) / (k' + 1) (a step's time grows at most in proportion to the rows it verifies)."""
    bounds = [t if other < k else t * (k + 1) / (other + 1) for other, t in others.items()]
    return max(bounds, default=None)


class AdaptiveSpeculation:
    def __init__(self, num_speculative_tokens: int, choices: Sequence[int] | None = None,
                 clock: StepClock | None = None, explore_every: int = EXPLORE_EVERY):
        self.num_speculative_tokens = num_speculative_tokens
        self.choices = tuple(sorted(set(choices or default_choices(num_speculative_tokens))))
        if not self.choices or min(self.choices) < 0 or max(self.choices) > num_speculative_tokens:
            raise ValueError(f"speculation choices {self.choices} must lie in 0..{num_speculative_tokens}")
        self.clock = clock or StepClock()
        self.exploration = Exploration(self.clock, explore_every)
        self.server = AcceptanceCurve(num_speculative_tokens, half_life=SERVER_HALF_LIFE)
        self.steps_by_k: dict[int, int] = dict.fromkeys(self.choices, 0)  # the choices made, for /metrics

    def request_curve(self) -> AcceptanceCurve:
        return AcceptanceCurve(self.num_speculative_tokens, half_life=REQUEST_HALF_LIFE,
                               prior_weight=REQUEST_PRIOR_WEIGHT)

    def observe(self, curve: AcceptanceCurve, countable: int, accepted: int) -> None:
        """One row's verify: into its request's curve and the server's."""
        curve.observe(countable, accepted)
        self.server.observe(countable, accepted)

    def outlook(self, curve: AcceptanceCurve | None, cap: int) -> RowOutlook:
        server = self.server.rates()
        expected = (curve.expected_accepted(server) if curve is not None
                    else self.server.expected_accepted())
        return RowOutlook(expected, cap)

    def choose(self, rows: Sequence[RowOutlook]) -> int:
        """The step's k for these rows; every explore_every-th step at a batch bucket, the choice
        measured longest ago instead."""
        num_seqs = len(rows)
        k = self.exploration.due(num_seqs, self.choices)
        if k is None:
            intervals = {choice: self.clock.intervals(num_seqs, choice) for choice in self.choices}
            k = best_k(rows, self.choices, lambda choice: step_seconds(intervals[choice]),
                       lambda choice: len(intervals[choice]) >= SETTLED_INTERVALS)
        self.steps_by_k[k] += 1
        return k

    def step_took(self, num_seqs: int, k: int, seconds: float) -> None:
        """A decode-only step of num_seqs rows verifying k drafts each took `seconds`."""
        if k in self.steps_by_k:
            self.clock.record(num_seqs, k, seconds)
