"""The hybrid's choice of a step against hand-computed tokens per second, and the step clock's
estimates against hand-computed medians."""

from __future__ import annotations

import random

import pytest

from target_service.proposers.hybrid_choice import (
    RowOutlook,
    StepChoice,
    choose_step,
    explore,
    unanimous_choice,
    weighed_times,
)
from target_service.proposers.step_clock import SETTLED_INTERVALS, WINDOW, StepClock, batch_bucket


def test_each_row_takes_the_better_proposal_when_the_drafter_runs():
    rows = [RowOutlook(3.0, 5.0), RowOutlook(4.0, 2.0), RowOutlook(2.0, None), RowOutlook(3.0, 3.0)]
    # with: 6 + 5 + 3 + 4 = 18 tokens in 2 s = 9/s; without: 6 + 3 + 1 + 4 = 14 in 2 s = 7/s
    assert choose_step(rows, 2.0, 2.0) == StepChoice(True, (0,))  # a tie (row 3) stays with DFlash


def test_a_cheaper_step_without_the_drafter_wins_when_it_emits_more_per_second():
    rows = [RowOutlook(4.0, 3.0), RowOutlook(4.0, 3.5)]
    # with: 5 + 5 = 10 in 0.10 s = 100/s; without: 4 + 4.5 = 8.5 in 0.08 s = 106/s
    assert choose_step(rows, 0.10, 0.08) == StepChoice(False, (0, 1))
    # ... but not at 0.09 s: 8.5 / 0.09 = 94/s
    assert choose_step(rows, 0.10, 0.09) == StepChoice(True, ())


def test_random_steps_pick_the_larger_rate():
    rng = random.Random()
    for _ in range(200):
        rows = [RowOutlook(rng.uniform(0, 7), rng.choice([None, rng.uniform(0, 7)]))
                for _ in range(rng.randint(1, 8))]
        time_with, time_without = rng.uniform(0.01, 0.2), rng.uniform(0.01, 0.2)
        with_rate = sum(1 + max(r.dflash, r.lookup or 0) for r in rows) / time_with
        without_rate = sum(1 + (r.lookup or 0) for r in rows) / time_without
        choice = choose_step(rows, time_with, time_without)
        every_row_on_the_lookup = all(r.lookup is not None and r.lookup > r.dflash for r in rows)
        assert choice.run_drafter == (with_rate >= without_rate and not every_row_on_the_lookup)
        if choice.run_drafter:
            better = [i for i, r in enumerate(rows) if r.lookup is not None and r.lookup > r.dflash]
            assert choice.lookup_rows == tuple(better)
        else:
            assert choice.lookup_rows == tuple(range(len(rows)))


def test_a_step_whose_every_row_takes_the_lookup_skips_the_drafter_whatever_the_times():
    rows = [RowOutlook(11.0, 15.0), RowOutlook(2.0, 2.5)]
    # the times say the drafter's step is faster (a disturbed lookup-only measurement), but its block
    # would go unread: both rows verify the lookup's continuation
    assert choose_step(rows, 0.055, 0.123) == StepChoice(False, (0, 1))
    assert choose_step([*rows, RowOutlook(3.0, 3.0)], 0.055, 0.123) == StepChoice(True, (0, 1))


def test_the_unanimous_shortcut_answers_as_choose_step_does_whatever_the_times():
    rng = random.Random()
    answered = 0
    for _ in range(400):
        rows = [RowOutlook(rng.uniform(0, 7), rng.choice([None, rng.uniform(0, 7), rng.uniform(5, 9)]))
                for _ in range(rng.randint(1, 4))]
        time_with = rng.choice([None, rng.uniform(0.01, 0.2)])
        shortcut = unanimous_choice(rows, time_with is not None)
        if shortcut is None:
            continue
        answered += 1
        for time_without in (None, rng.uniform(0.01, 0.2), 10 * time_with):
            assert choose_step(rows, time_with, time_without) == shortcut
    assert answered > 20
    # not where a row expects more of DFlash, nor while the drafter's step was never timed
    assert unanimous_choice([RowOutlook(3.0, 5.0), RowOutlook(4.0, 2.0)], True) is None
    assert unanimous_choice([RowOutlook(3.0, 5.0)], False) is None
    assert unanimous_choice([RowOutlook(3.0, 5.0)], True) == StepChoice(False, (0,))


def test_weighed_times_by_hand():
    # settled kinds: each one's low quantile (rank round(0.25 (n + 1))), the lookup-only one capped
    assert weighed_times([5.0, 1.0, 3.0, 9.0], [2.0, 8.0, 4.0]) == (1.0, 1.0)
    assert weighed_times([6.0, 5.0, 7.0], [2.0, 8.0, 4.0]) == (5.0, 2.0)
    # the 123 ms lookup-only interval of the lock-in, alone: not settled, so measured again
    assert weighed_times([0.055] * 5, [0.123]) == (0.055, None)
    # ... and once settled, never weighed above the drafter's step
    assert weighed_times([0.055] * 5, [0.123, 0.034, 0.035]) == (0.055, 0.034)
    assert weighed_times([0.055] * 5, [0.123, 0.123, 0.123]) == (0.055, 0.055)
    # the drafter's step, settled or not, at its own low quantile; the lookup-only one capped by it
    assert weighed_times([0.090], [0.030, 0.031, 0.032]) == (0.090, 0.030)
    assert weighed_times([0.020], [0.030, 0.031, 0.032]) == (0.020, 0.020)
    assert weighed_times([], [0.030] * SETTLED_INTERVALS) == (None, 0.030)


def test_exploring_takes_the_kind_asked_for_with_the_rows_it_would_have():
    rows = [RowOutlook(3.0, 5.0), RowOutlook(4.0, None)]
    assert explore(rows, True) == StepChoice(True, (0,))
    assert explore(rows, False) == StepChoice(False, (0, 1))


def test_an_unknown_time_is_measured_the_lookup_only_one_first_where_some_row_matches():
    matched, partly = [RowOutlook(6.0, 1.0)] * 2, [RowOutlook(6.0, 1.0), RowOutlook(6.0, None)]
    unmatched = [RowOutlook(6.0, None)] * 2
    assert choose_step(matched, None, None) == StepChoice(False, (0, 1))  # its time is measured once
    assert choose_step(partly, None, None) == StepChoice(False, (0, 1))  # one row is enough to try
    assert choose_step(partly, 0.05, None) == StepChoice(False, (0, 1))  # ... even with the drafter's known
    assert choose_step(unmatched, None, None) == StepChoice(True, ())  # nothing to try the lookup on
    assert choose_step(unmatched, 0.05, None) == StepChoice(True, ())
    assert choose_step(matched, None, 0.05) == StepChoice(True, ())  # then the drafter's time is measured
    assert choose_step(partly, None, 0.05) == StepChoice(True, ())


def test_the_clock_files_each_interval_under_its_kind_and_batch_bucket():
    clock = StepClock()
    assert clock.estimate(3, True) is None
    for seconds, drafter_runs in [(0.10, True), (0.04, False), (0.12, True), (0.05, False), (0.11, True)]:
        clock.record(3, drafter_runs, seconds)
    assert clock.estimate(4, True) == pytest.approx(0.11)  # median of 0.10, 0.12, 0.11; 3, 4 share a bucket
    assert clock.estimate(3, False) == pytest.approx(0.045)
    assert clock.estimate(5, True) is None  # batches of 5-8 are another bucket


def test_the_clock_keeps_a_window_so_one_disturbed_step_moves_it_little():
    clock = StepClock()
    for seconds in [30.0] + [0.02] * (WINDOW + 1):
        clock.record(1, False, seconds)
    assert clock.estimate(1, False) == pytest.approx(0.02)
    assert len(clock.intervals(1, False)) == WINDOW  # the oldest fell out of the window


@pytest.mark.parametrize("num_seqs,bucket",
                         [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (32, 32), (33, 64)])
def test_batch_buckets_are_powers_of_two(num_seqs, bucket):
    assert batch_bucket(num_seqs) == bucket


def test_every_explore_every_th_step_at_a_batch_size_measures_the_stale_kind_again():
    from types import SimpleNamespace

    from target_service.proposers.hybrid import HybridProposer
    from target_service.proposers.hybrid_choice import EXPLORE_EVERY
    from target_service.proposers.step_clock import Exploration

    clock = StepClock()
    for _ in range(SETTLED_INTERVALS):
        clock.record(2, False, 0.030)  # the lookup-only kind: measured first, so the stale one
    for _ in range(SETTLED_INTERVALS):
        clock.record(2, True, 0.040)
    proposer = SimpleNamespace(clock=clock, exploration=Exploration(clock))
    rows = [RowOutlook(6.0, None), RowOutlook(5.0, 1.0)]  # DFlash's rows: the drafter wins on the rates
    choices = [HybridProposer._choose(proposer, rows) for _ in range(2 * EXPLORE_EVERY)]
    lookup_only = [i + 1 for i, choice in enumerate(choices) if not choice.run_drafter]
    assert lookup_only == [EXPLORE_EVERY, 2 * EXPLORE_EVERY]
    assert HybridProposer._choose(proposer, rows[:1]) == StepChoice(True, ())  # batch 1: its own count
