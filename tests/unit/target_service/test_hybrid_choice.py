"""The hybrid's choice of a step against hand-computed tokens per second, and the step clock's
estimates against hand-computed medians."""

from __future__ import annotations

import random

import pytest

from target_service.proposers.hybrid_choice import RowOutlook, StepChoice, choose_step
from target_service.proposers.step_clock import WINDOW, StepClock, batch_bucket


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
        assert choice.run_drafter == (with_rate >= without_rate)
        if choice.run_drafter:
            better = [i for i, r in enumerate(rows) if r.lookup is not None and r.lookup > r.dflash]
            assert choice.lookup_rows == tuple(better)
        else:
            assert choice.lookup_rows == tuple(range(len(rows)))


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
