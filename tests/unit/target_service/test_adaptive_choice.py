"""Adaptive speculation's pieces alone: the acceptance curve against a float64 recount of its
observations, the choice of k against an exhaustive search in exact fractions, the exploration
rule, and the scheduler planning the chosen k (and a request's own draft limit) over a fake pool."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from fake_pool import FakePool

from target_service.engine.acceptance_curve import AcceptanceCurve, expected_from_rates
from target_service.engine.adaptive_speculation import (
    AdaptiveSpeculation,
    RowOutlook,
    best_k,
    default_choices,
)
from target_service.engine.draft_budget import DraftBudget
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.scheduler import Scheduler
from target_service.engine.sequence import Sequence
from target_service.proposers.step_clock import SETTLED_INTERVALS, StepClock, step_seconds

GREEDY = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)


def recounted_rates(observations, num_positions, half_life, prior_weight, prior):
    """The curve's rates recomputed from scratch: observation j of n weighs 2^-((n-1-j)/half_life)."""
    n = len(observations)
    tried = [0.0] * num_positions
    accepted = [0.0] * num_positions
    for j, (countable, taken) in enumerate(observations):
        weight = 0.5 ** ((n - 1 - j) / half_life)
        for position in range(min(countable, num_positions)):
            if position < taken:
                tried[position] += weight
                accepted[position] += weight
            elif position == taken:
                tried[position] += weight
    return [(a + prior_weight * p) / (t + prior_weight) for t, a, p in zip(tried, accepted, prior)]


def test_the_curve_counts_each_position_as_tried_accepted_or_untouched_and_forgets_by_half_life():
    rng = random.Random()
    num_positions, half_life, weight = 7, rng.uniform(3, 40), rng.uniform(0.5, 8)
    curve = AcceptanceCurve(num_positions, half_life=half_life, prior_weight=weight)
    observations = []
    for _ in range(rng.randint(20, 80)):
        countable = rng.randint(0, num_positions)
        taken = rng.randint(0, countable)
        curve.observe(countable, taken)
        if countable:
            observations.append((countable, taken))
    prior = [rng.random() for _ in range(num_positions)]
    assert curve.rates(prior) == pytest.approx(recounted_rates(observations, num_positions, half_life,
                                                               weight, prior), rel=1e-9)
    assert curve.num_observations == len(observations)


def test_expected_accepted_drafts_are_the_sums_of_the_survival_products():
    # by hand: p = 1/2, 1/2, 1: E[1] = 1/2, E[2] = 1/2 + 1/4, E[3] = E[2] + 1/4
    assert expected_from_rates([0.5, 0.5, 1.0]) == [0.0, 0.5, 0.75, 1.0]
    curve = AcceptanceCurve(3, half_life=1e9, prior_weight=1e-9)
    for _ in range(4):
        curve.observe(3, 3)  # always all three: every rate ~1
    assert curve.expected_accepted() == pytest.approx([0, 1, 2, 3], abs=1e-6)


def test_an_impossible_observation_is_refused():
    curve = AcceptanceCurve(4, half_life=10)
    with pytest.raises(ValueError, match="accepted 3 drafts of 2"):
        curve.observe(2, 3)


def exhaustive_best(rows, choices, times) -> int:
    """The k of most tokens per second, in exact fractions; ties to the larger k."""
    def rate(k):
        tokens = sum(1 + Fraction(row.expected[min(k, row.cap)]) for row in rows)
        return tokens / Fraction(times[k])
    return max(sorted(choices), key=lambda k: (rate(k), k))


def test_the_choice_is_the_k_of_most_tokens_per_second_for_random_rows_and_times():
    rng = random.Random()
    for _ in range(300):
        K = rng.choice([3, 7, 15])
        choices = default_choices(K)
        rows = []
        for _ in range(rng.randint(1, 12)):
            rates = [rng.random() ** rng.choice([0.2, 1, 3]) for _ in range(K)]
            rows.append(RowOutlook(expected_from_rates(rates), rng.randint(0, K)))
        times = {k: rng.uniform(1e-3, 3e-2) for k in choices}
        assert best_k(rows, choices, times.get) == exhaustive_best(rows, choices, times)


def test_by_hand_a_memory_bound_step_keeps_k_and_a_compute_bound_one_drops_weak_drafts():
    choices = (0, 1, 3, 7)
    strong = [RowOutlook(expected_from_rates([0.9] * 7), 7)]  # E[3] 2.439, E[7] 4.695
    weak = [RowOutlook(expected_from_rates([0.3] * 7), 7)] * 32  # E[1] 0.3, E[3] 0.417, E[7] 0.428
    flat = {0: 5.0, 1: 5.1, 3: 5.2, 7: 5.4}  # batch 1 on a GPU: the weights' read dominates
    assert best_k(strong, choices, flat.get) == 7  # 5.695 / 5.4 against 3.439 / 5.2
    assert best_k(weak, choices, flat.get) == 3  # 32 x 1.417 / 5.2 against 32 x 1.428 / 5.4
    rows_bound = {k: 1.0 * (k + 1) for k in choices}  # time in proportion to rows verified
    assert best_k(weak, choices, rows_bound.get) == 0  # 1 / 1 beats 1.3 / 2 and the rest
    assert best_k(weak, choices, lambda k: None) == 7  # nothing measured yet: K, as without adaptation


def test_an_unmeasured_k_is_tried_where_it_could_win_and_then_its_measurement_decides():
    weak = [RowOutlook(expected_from_rates([0.2] * 7), 7)] * 8
    measured = {7: 8.0}  # only K measured: k 0 is estimated at 1 / 8 of it, so it is tried
    assert best_k(weak, (0, 3, 7), measured.get) == 0
    measured[0] = 7.9  # it was not cheaper after all: the measurement now decides
    assert best_k(weak, (0, 3, 7), measured.get) in (3, 7)


def test_one_slow_first_interval_does_not_rule_a_k_out_until_it_settles():
    strong = [RowOutlook(expected_from_rates([0.9] * 7), 7)]
    measured = {7: 3.0, 3: 1.0}  # K's one interval three times slow (warm-up); 3 at its true 1.0
    unsettled = {7: False, 3: True}
    assert best_k(strong, (3, 7), measured.get, unsettled.get) == 7  # K weighed at least as 3 costs
    assert best_k(strong, (3, 7), measured.get) == 3  # settled, the measurement decides


def test_a_k_is_timed_by_a_low_order_statistic_of_its_intervals():
    intervals = [random.uniform(1.0, 2.0) for _ in range(random.randint(7, 15))]
    rank = round(0.25 * (len(intervals) + 1))
    assert step_seconds(intervals) == sorted(intervals)[rank - 1]
    assert step_seconds([*intervals, 100.0]) <= sorted(intervals)[rank]  # an outlier moves it <= 1 rank
    assert step_seconds([5.0]) == 5.0 and step_seconds([]) is None


def test_every_explore_every_th_step_takes_the_choice_measured_longest_ago():
    speculation = AdaptiveSpeculation(7, (0, 3, 7), clock=StepClock(), explore_every=4)
    strong = [speculation.outlook(None, 7)]
    for _ in range(SETTLED_INTERVALS):  # settled, so measurements alone decide between explorations
        for k in (7, 3, 0):
            speculation.step_took(1, k, 1.0)  # 7 measured longest ago, then 3, then 0
    picks = [speculation.choose(strong) for _ in range(8)]
    assert picks[3] == 7  # the 4th step explores the oldest measurement
    assert [picks[i] for i in (0, 1, 2, 4, 5, 6)] == [best_k(strong, (0, 3, 7), lambda k: 1.0)] * 6
    assert sum(speculation.steps_by_k.values()) == 8


def test_choices_and_settings_out_of_range_are_refused():
    assert default_choices(15) == (0, 1, 3, 7, 15)
    assert default_choices(5) == (0, 1, 3, 5)
    with pytest.raises(ValueError, match=r"must lie in 0\.\.3"):
        AdaptiveSpeculation(3, (0, 7))


class FixedChoice(AdaptiveSpeculation):
    """The real bookkeeping, with the choice fixed by the test."""

    def __init__(self, k: int, num_speculative_tokens: int):
        super().__init__(num_speculative_tokens)
        self.k, self.rows_seen = k, []

    def choose(self, rows):
        self.rows_seen.append(list(rows))
        return self.k


def decoding(scheduler: Scheduler, params_list) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", i, list(range(1, 9)), params, i) for i, params in enumerate(params_list)]
    for seq in seqs:
        scheduler.add(seq)
    plan = scheduler.schedule()
    for chunk in plan.prefills:
        chunk.seq.num_computed = chunk.start + chunk.num_tokens
        chunk.seq.output_token_ids.append(7)
    scheduler.commit(plan.seqs)
    return seqs


def test_the_scheduler_plans_the_chosen_k_and_a_requests_own_limit_lowers_only_its_count():
    k_max, chosen = 7, 3
    speculation = FixedChoice(chosen, k_max)
    scheduler = Scheduler(FakePool(64), max_num_seqs=4, max_num_batched_tokens=64,
                          draft_budget=DraftBudget(k_max, 64), speculation=speculation)
    limited = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, num_speculative_tokens=1)
    seqs = decoding(scheduler, [GREEDY, limited, GREEDY])
    plan = scheduler.schedule()
    assert [(w.seq, w.num_verified, min(w.max_accepted, w.num_verified)) for w in plan.decodes] == [
        (seqs[0], chosen, chosen), (seqs[1], chosen, 1), (seqs[2], chosen, chosen)]
    assert [row.cap for row in speculation.rows_seen[-1]] == [k_max, 1, k_max]  # caps before the choice
    # a step ahead cannot apply a request's own limit on the device: it is not planned ahead
    assert scheduler.schedule_ahead(plan, [w.num_verified for w in plan.decodes]) is None


def test_a_step_ahead_verifies_the_choice_made_for_it():
    speculation = FixedChoice(1, 7)
    scheduler = Scheduler(FakePool(64), max_num_seqs=2, max_num_batched_tokens=64,
                          draft_budget=DraftBudget(7, 64), speculation=speculation)
    decoding(scheduler, [GREEDY, GREEDY])
    plan = scheduler.schedule()
    speculation.k = 3
    ahead = scheduler.schedule_ahead(plan, [w.num_verified for w in plan.decodes])
    assert [(w.num_verified, w.max_accepted) for w in ahead.decodes] == [(3, 3), (3, 3)]
    for seq, work in zip([w.seq for w in plan.decodes], plan.decodes):
        # pages for the longest outcome: every draft of the current step accepted, then 3 + 1 rows
        assert len(seq.block_table) * 16 >= seq.num_computed + work.num_verified + 1 + 3 + 1
