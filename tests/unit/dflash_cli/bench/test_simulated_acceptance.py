"""The step bench's per-position acceptance curves: each shape solved to the asked mean over K
drafts, and the draws follow it, also for a step that verifies fewer (checked against closed forms
and a float64 recount, over fresh random draws)."""

import random

import pytest
import torch

from dflash_cli.bench.simulated_acceptance import SimulatedAcceptance, expected_accepted, solve_rates


@pytest.mark.parametrize("curve", ["geometric", "flat", "steep"])
def test_a_curve_is_solved_to_the_mean_and_its_draws_follow_it_at_every_draft_count(curve):
    mean, k = random.uniform(2.0, 9.0), 15
    rates = solve_rates(curve, mean, k)
    assert 1 + expected_accepted(rates) == pytest.approx(mean, abs=1e-9)
    if curve == "geometric":  # closed form: p + p^2 + ... + p^15
        p = rates[0]
        assert expected_accepted(rates) == pytest.approx(p * (1 - p**k) / (1 - p))
    simulated = SimulatedAcceptance(mean, seed=random.randrange(2**31), curve=curve, num_positions=k)
    count = 40_000
    drafts = torch.tensor([random.choice([0, 1, 3, 7, 15]) for _ in range(count)])
    drawn = simulated(None, None, None, None, drafts)
    assert (drawn <= drafts).all() and (drawn >= 0).all()
    for verified in (1, 3, 7, 15):
        rows = drawn[drafts == verified].double()
        survival = [float(torch.tensor(rates[:j], dtype=torch.float64).prod())
                    for j in range(1, verified + 1)]
        expected = sum(survival)  # E[accepted | verified drafts] = sum of survival probabilities
        spread = 4 * (rows.var().item() / rows.numel()) ** 0.5 + 1e-9
        assert abs(rows.mean().item() - expected) < spread, (verified, rows.mean().item(), expected)


def test_a_mean_the_block_cannot_reach_and_an_unknown_curve_are_refused():
    with pytest.raises(ValueError, match="needs 1 <= mean"):
        solve_rates("geometric", 17.0, 15)
    with pytest.raises(ValueError, match="acceptance curve 'linear'"):
        SimulatedAcceptance(6.5, seed=0, curve="linear")
