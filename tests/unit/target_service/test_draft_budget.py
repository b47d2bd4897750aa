"""The draft budget's two forms agree: the device's vectorised rule equals the host's on random states,
and the host's equals the rule worked out by hand."""

import pytest
import torch

from target_service.engine.draft_budget import DraftBudget


@pytest.mark.parametrize("draw", range(10))
def test_the_device_form_equals_the_host_form_on_random_states(draw):
    budget = DraftBudget(int(torch.randint(0, 16, ())), int(torch.randint(2, 200, ())))
    num_computed = torch.randint(0, budget.max_model_len + 5, (64,))
    remaining = torch.randint(-3, 40, (64,))
    on_device = budget.max_accepted_on_device(num_computed, remaining).tolist()
    on_host = [budget.max_accepted(n, left) for n, left in zip(num_computed.tolist(), remaining.tolist())]
    assert on_device == on_host


def test_the_host_form_by_hand():
    budget = DraftBudget(num_speculative_tokens=7, max_model_len=100)
    assert budget.max_accepted(10, 50) == 7  # far from both limits: K
    assert budget.max_accepted(95, 50) == 3  # rows 95..98 and the token after them fit 100
    assert budget.max_accepted(10, 3) == 2  # 2 accepted + 1 target token = the 3 left
    assert budget.max_accepted(98, 50) == 0 and budget.max_accepted(10, 1) == 0
    assert budget.verifies_full_block(91) and not budget.verifies_full_block(92)  # 91 + 7 + 2 = 100
