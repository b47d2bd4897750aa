"""Which proposer drafts each row of a hybrid step, and whether the DFlash drafter runs at all.

A pure rule over numbers, so it can be checked by hand. Per row, the expected drafts accepted from
DFlash's block and from the lookup's continuation (`RowOutlook`); per step, the time of a step with
the drafter and without it (`StepClock`). Two candidate steps:
- the drafter runs: every row verifies the better of its two proposals, and the step takes
  `time_with`;
- it does not: every row verifies the lookup's continuation (a row without a usable match gains
  only its bonus token), and the step takes `time_without`.
The one with more expected tokens per second is taken (a tie keeps the drafter, so a sequence
DFlash serves as well is not moved). Tokens per row are 1 + accepted: the target's bonus token is
emitted whichever proposer drafted.

Before both times are known there is nothing to weigh, so the unknown one is measured: a step skips
the drafter while the lookup-only time of its batch size is unknown and some row has a usable
lookup match (one such step per batch size; a sequence that copies starts on the lookup), and runs
it while the time with the drafter is unknown. Waiting for every row to match instead left a batch
with one unmatched row on the drafter for good, its lookup-only time never measured (a batch of
four that copies at 0.67 of the lookup's tok/s on the demo pair).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowOutlook:
    dflash: float  # expected drafts accepted from DFlash's block
    lookup: float | None  # ... from the lookup's continuation; None: no usable match this step


@dataclass(frozen=True)
class StepChoice:
    run_drafter: bool
    lookup_rows: tuple[int, ...]  # the rows that verify the lookup's continuation


def choose_step(rows: list[RowOutlook], time_with: float | None, time_without: float | None) -> StepChoice:
    with_drafter = StepChoice(True, tuple(i for i, row in enumerate(rows)
                                          if row.lookup is not None and row.lookup > row.dflash))
    lookup_only = StepChoice(False, tuple(range(len(rows))))
    if time_without is None:
        return lookup_only if any(row.lookup is not None for row in rows) else with_drafter
    if time_with is None:
        return with_drafter
    gain_with = sum(1 + max(row.dflash, row.lookup or 0.0) for row in rows)
    gain_without = sum(1 + (row.lookup or 0.0) for row in rows)
    return lookup_only if gain_without / time_without > gain_with / time_with else with_drafter
