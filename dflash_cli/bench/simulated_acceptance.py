"""SimulatedAcceptance: realistic acceptance lengths for benchmarks whose drafters are random.

A random drafter is almost never accepted, so a step bench would time the one-token path only. Inside
a bench process this replaces the engine's accepted-lengths function (only a bench enters it; nothing
the server runs can turn it on) with draws from a Poisson around MEAN - 1, capped at each sequence's
draft count, so the step's variable-length paths run at a realistic acceptance and tokens/s is
measured, not extrapolated.
"""

from __future__ import annotations

import torch

from foundation.host_transfer import to_device


class SimulatedAcceptance:
    """Replaces `target_service.runner.verify.accepted_lengths` in this process: accepted ~ Poisson(MEAN - 1),
    capped at each sequence's draft count (drawn on the host, one small copy to the device)."""

    def __init__(self, mean: float, seed: int):
        import target_service.runner.verify as verify_module

        self.module, self.original = verify_module, verify_module.accepted_lengths
        self.rate = max(mean - 1.0, 0.0)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, drafts, targets, owners, columns, num_drafts: torch.Tensor) -> torch.Tensor:
        rates = torch.full((num_drafts.shape[0],), self.rate)
        drawn = torch.poisson(rates, generator=self.generator).to(torch.int64).tolist()
        return torch.minimum(to_device(drawn, torch.int64, num_drafts.device), num_drafts)

    def __enter__(self):
        self.module.accepted_lengths = self
        return self

    def __exit__(self, *exc):
        self.module.accepted_lengths = self.original
