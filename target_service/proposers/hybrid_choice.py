"""Which proposer drafts each row of a hybrid step, and whether the DFlash drafter runs at all.

A pure rule over numbers, so it can be checked by hand. Per row, the expected drafts accepted from
DFlash's block and from the lookup's continuation (`RowOutlook`); per step, the time of a step with
the drafter and without it (`StepClock`). Two candidate steps:
- the drafter runs: every row verifies the better of its two proposals, and the step takes
  `time_with`;
- it does not: every row verifies the lookup's continuation (a row without a usable match gains
  only its bonus token), and the step takes `time_without`.
The one with more expected tokens per second is taken (a tie keeps the drafter, so a sequence
DFlash serves as well is not moved), except that a step where every row would verify the lookup's
continuation anyway skips the drafter: its block would go unread. Tokens per row are 1 + accepted:
the target's bonus token is emitted whichever proposer drafted.

The times weighed (`weighed_times`) are each kind's low quantile (`step_clock.step_seconds`), with
what is known of steps: a step without the drafter does less of the same work, so it is weighed at
no more than one with it; and until the lookup-only step has `SETTLED_INTERVALS` intervals it counts
as unknown, so it is measured where a row matches. (The drafter's step needs no such care: any row
without a usable match takes it, which measures it again; weighing an unsettled one as cheap cost a
cold engine drafter steps on prompts the lookup copies whole.) Every `EXPLORE_EVERY` steps at a batch
size the kind measured longer ago is taken once (`explore`, when `step_clock.Exploration` says),
so a stale time is corrected. Without
these, one disturbed first lookup-only interval (123 ms against 55 ms steps with the drafter, on the
demo pair on a CPU) kept the drafter running for good, even in steps where every row verified the
lookup's proposal.

Before both times are known there is nothing to weigh, so the unknown one is measured: a step skips
the drafter while the lookup-only time of its batch size is unknown and some row has a usable
lookup match (one such step per batch size; a sequence that copies starts on the lookup), and runs
it while the time with the drafter is unknown. Waiting for every row to match instead left a batch
with one unmatched row on the drafter for good, its lookup-only time never measured (a batch of
four that copies at 0.67 of the lookup's tok/s on the demo pair).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from target_service.proposers.step_clock import EXPLORE_EVERY, SETTLED_INTERVALS, step_seconds

__all__ = ["EXPLORE_EVERY", "RowOutlook", "StepChoice", "choose_step", "explore", "unanimous_choice",
           "weighed_times"]


@dataclass(frozen=True)
class RowOutlook:
    dflash: float  # expected drafts accepted from DFlash's block
    lookup: float | None  # ... from the lookup's continuation; None: no usable match this step


@dataclass(frozen=True)
class StepChoice:
    run_drafter: bool
    lookup_rows: tuple[int, ...]  # the rows that verify the lookup's continuation


def weighed_times(with_drafter: Sequence[float], without: Sequence[float]
                  ) -> tuple[float | None, float | None]:
    """(time with the drafter, time without) for `choose_step`, from each kind's latest intervals."""
    time_with, time_without = step_seconds(with_drafter), step_seconds(without)
    if len(without) < SETTLED_INTERVALS:
        time_without = None
    if time_with is not None and time_without is not None:
        time_without = min(time_without, time_with)
    return time_with, time_without


def explore(rows: list[RowOutlook], run_drafter: bool) -> StepChoice:
    """The step of the kind to be measured again, its rows as `choose_step` would give them."""
    return _with_drafter(rows) if run_drafter else _lookup_only(rows)


def _with_drafter(rows: list[RowOutlook]) -> StepChoice:
    return StepChoice(True, tuple(i for i, row in enumerate(rows)
                                  if row.lookup is not None and row.lookup > row.dflash))


def _lookup_only(rows: list[RowOutlook]) -> StepChoice:
    return StepChoice(False, tuple(range(len(rows))))


def unanimous_choice(rows: list[RowOutlook], time_with_known: bool) -> StepChoice | None:
    """`choose_step`'s answer where it needs no step times, else None: every row expects more from the
    lookup than from DFlash, so the drafter's block would go unread, and the time with the drafter is
    known (while it is not, `choose_step` runs the drafter to measure it). The common step of a
    sequence that copies, answered without weighing the clock's intervals."""
    if time_with_known and all(row.lookup is not None and row.lookup > row.dflash for row in rows):
        return _lookup_only(rows)
    return None


def choose_step(rows: list[RowOutlook], time_with: float | None, time_without: float | None) -> StepChoice:
    with_drafter, lookup_only = _with_drafter(rows), _lookup_only(rows)
    if time_without is None:
        return lookup_only if any(row.lookup is not None for row in rows) else with_drafter
    if time_with is None:
        return with_drafter
    if with_drafter.lookup_rows == lookup_only.lookup_rows:  # the drafter's block would go unread
        return lookup_only
    gain_with = sum(1 + max(row.dflash, row.lookup or 0.0) for row in rows)
    gain_without = sum(1 + (row.lookup or 0.0) for row in rows)
    return lookup_only if gain_without / time_without > gain_with / time_with else with_drafter
