"""Adaptive speculation's choice loop against a simulated machine: a fake step-time model and a
drafter of known geometric acceptance, with the engine's order of events (async scheduling chooses
a step before the one in flight is timed; the first step has no interval). The reference is the
same model's best fixed k, computed in closed form here, never by the code under test.

What is protected: a cold engine at batch 1, whose first intervals are slow (warm-up, first graph
replays), still settles on K (every k costs alike there), and a compute-bound batch still finds the
small k that wins there."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from target_service.engine.adaptive_speculation import AdaptiveSpeculation, default_choices

K = 15
MEAN_ACCEPTANCE_LENGTH = 6.5  # at K: 1 + p + p^2 + ... + p^15
STEPS = 140
WARM_UP = 40


def geometric_rate(mean_length: float, num_positions: int) -> float:
    """The p whose p + ... + p^num_positions is mean_length - 1 (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(100):
        middle = (low + high) / 2
        if sum(middle ** j for j in range(1, num_positions + 1)) < mean_length - 1:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def true_tokens_per_row(p: float, k: int) -> float:
    """1 + E[drafts accepted of k], in closed form for the geometric curve."""
    return 1.0 + sum(p ** j for j in range(1, k + 1))


def drawn_accepted(rng: random.Random, p: float, k: int) -> int:
    accepted = 0
    while accepted < k and rng.random() < p:
        accepted += 1
    return accepted


@dataclass
class Machine:
    """Step seconds: base(k) at this batch, times a slowdown for the first `slow_steps` steps of the
    engine, times small multiplicative noise."""
    base: Callable[[int], float]
    slow_steps: int = 0
    slowdown: float = 3.0
    noise: float = 0.01

    def mean_seconds(self, step: int, k: int) -> float:
        return self.base(k) * (self.slowdown if step < self.slow_steps else 1.0)

    def drawn_seconds(self, rng: random.Random, step: int, k: int) -> float:
        return self.mean_seconds(step, k) * (1.0 + abs(rng.gauss(0.0, self.noise)))


def rate_of(machine: Machine, p: float, batch: int, picks: list[int], start: int = 0) -> float:
    """Expected tokens per second of these per-step choices from step `start` on (in closed form:
    the true expectation of each choice over the machine's mean time, so no draw noise)."""
    steps = range(start, len(picks))
    tokens = sum(batch * true_tokens_per_row(p, picks[step]) for step in steps)
    return tokens / sum(machine.mean_seconds(step, picks[step]) for step in steps)


def fixed_k_rate(machine: Machine, p: float, batch: int, k: int, start: int = 0) -> float:
    """The reference: k at every step."""
    return rate_of(machine, p, batch, [k] * STEPS, start)


def simulated_run(machine: Machine, p: float, batch: int, rng: random.Random,
                  steps: int = STEPS) -> list[int]:
    """Adaptive speculation's choice at each of `steps` decode steps; the acceptance it learns from
    and the step times it is told are drawn."""
    speculation = AdaptiveSpeculation(K, default_choices(K))
    curves = [speculation.request_curve() for _ in range(batch)]
    picks: list[int] = []
    for step in range(steps):
        k = speculation.choose([speculation.outlook(curve, K) for curve in curves])  # before the read
        if picks:  # the step in flight is timed now; the engine's first step has no interval
            done, done_k = step - 1, picks[-1]
            if done > 0:
                speculation.step_took(batch, done_k, machine.drawn_seconds(rng, done, done_k))
            for curve in curves:
                speculation.observe(curve, done_k, drawn_accepted(rng, p, done_k))
        picks.append(k)
    return picks


def flat_batch_one(slow_steps: int, slowdown: float) -> Machine:
    """Batch 1 on an H200: the verify reads the weights once whatever k (6.7-6.9 ms measured)."""
    jitter = random.Random()
    times = {k: 6.8e-3 * (1 + jitter.uniform(-0.01, 0.01)) for k in range(K + 1)}
    return Machine(times.__getitem__, slow_steps=slow_steps, slowdown=slowdown)


def compute_bound_batch(batch: int, slow_steps: int, slowdown: float) -> Machine:
    """A large batch: a fixed cost plus one in proportion to the rows verified (batch x (k + 1)),
    drawn afresh so the best fixed k moves between draws (7 or 3 for the geometric curve)."""
    rng = random.Random()
    fixed, per_row = rng.uniform(4e-3, 6e-3), rng.uniform(0.03e-3, 0.05e-3)
    return Machine(lambda k: fixed + per_row * batch * (k + 1), slow_steps=slow_steps, slowdown=slowdown)


def best_fixed(machine: Machine, p: float, batch: int, start: int = 0) -> tuple[int, float]:
    rates = {k: fixed_k_rate(machine, p, batch, k, start) for k in default_choices(K)}
    best = max(rates, key=rates.get)
    return best, rates[best]


def after_warm_up_share(picks: list[int], k: int) -> float:
    settled = picks[WARM_UP:]
    return settled.count(k) / len(settled)


def test_a_cold_engine_at_batch_one_settles_on_k_despite_slow_first_steps():
    p, rng = geometric_rate(MEAN_ACCEPTANCE_LENGTH, K), random.Random()
    machine = flat_batch_one(slow_steps=rng.randint(2, 6), slowdown=rng.uniform(2.0, 4.0))
    best, reference = best_fixed(machine, p, 1)
    assert best == K  # every k costs alike here: the reference says K
    picks = simulated_run(machine, p, 1, rng)
    assert rate_of(machine, p, 1, picks) >= 0.95 * reference, picks[:WARM_UP]
    assert after_warm_up_share(picks, K) >= 0.95, picks  # off K only when exploring (1 in 64)


def test_a_compute_bound_batch_finds_the_small_k_that_wins_there():
    """Every k is tried a few times at first (an unsettled k may have been unlucky), so the first
    steps cost a little; after them the choice is within 5% of the best fixed k."""
    p, rng = geometric_rate(MEAN_ACCEPTANCE_LENGTH, K), random.Random()
    machine = compute_bound_batch(32, slow_steps=rng.randint(0, 4), slowdown=rng.uniform(1.5, 3.0))
    best, reference = best_fixed(machine, p, 32, start=WARM_UP)
    assert best < K and fixed_k_rate(machine, p, 32, K, WARM_UP) < 0.97 * reference  # K loses here
    picks = simulated_run(machine, p, 32, rng)
    assert rate_of(machine, p, 32, picks, start=WARM_UP) >= 0.95 * reference, (best, picks)
    assert rate_of(machine, p, 32, picks) >= 0.85 * best_fixed(machine, p, 32)[1], picks[:WARM_UP]
