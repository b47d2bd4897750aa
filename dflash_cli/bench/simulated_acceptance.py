"""SimulatedAcceptance: realistic acceptance lengths for benchmarks whose drafters are random.

A random drafter is almost never accepted, so a step bench would time the one-token path only. Inside
a bench process this replaces the engine's accepted-lengths function (only a bench enters it; nothing
the server runs can turn it on) with draws that have a realistic mean, so the step's variable-length
paths run at a realistic acceptance and tokens/s is measured, not extrapolated.

Two ways to draw, by `curve`:
- "poisson" (the default, as before): accepted ~ Poisson(MEAN - 1), capped at each sequence's draft
  count. Its mean does not depend on how many drafts were verified, which is fine for a fixed K but
  would flatter a step that verifies fewer.
- a per-position curve ("geometric", "flat", "steep"): draft i is accepted with conditional chance
  p_i given drafts 1..i-1 were, and a step accepts drafts up to its first rejection among the ones it
  verified. So verifying k drafts accepts E[k] = p_1 + p_1 p_2 + ... on average, as a real drafter's
  blocks do, which is what judges adaptive speculation fairly. The curve's scale is solved so that
  verifying all `num_positions` (K) drafts gives mean acceptance length MEAN (1 + accepted):
  geometric p_i = p (survival p^i); flat p_i = p^(i/K) (the first drafts nearly always accepted,
  the late ones seldom: a survival curve flatter at first); steep p_i = p^(1/i) (the first draft
  often rejected, but a run once begun goes on: a survival curve that falls fast, then levels).
"""

from __future__ import annotations

import torch

from foundation.host_transfer import to_device

CURVES = ("poisson", "geometric", "flat", "steep")


def curve_rates(curve: str, scale: float, num_positions: int) -> list[float]:
    """p_1..p_K of a curve shape at `scale` in (0, 1)."""
    if curve == "geometric":
        return [scale] * num_positions
    if curve == "flat":
        return [scale ** (i / num_positions) for i in range(1, num_positions + 1)]
    if curve == "steep":
        return [scale ** (1 / i) for i in range(1, num_positions + 1)]
    raise ValueError(f"acceptance curve {curve!r}: expected one of {', '.join(CURVES)}")


def expected_accepted(rates: list[float]) -> float:
    expected, survive = 0.0, 1.0
    for rate in rates:
        survive *= rate
        expected += survive
    return expected


def solve_rates(curve: str, mean: float, num_positions: int) -> list[float]:
    """The curve's rates whose K drafts accept MEAN - 1 on average (bisection on the scale)."""
    target = mean - 1.0
    if not 0.0 <= target < num_positions:
        raise ValueError(f"a mean acceptance length of {mean} needs 1 <= mean < K + 1 = {num_positions + 1}")
    low, high = 0.0, 1.0
    for _ in range(100):
        middle = (low + high) / 2
        if expected_accepted(curve_rates(curve, middle, num_positions)) < target:
            low = middle
        else:
            high = middle
    return curve_rates(curve, (low + high) / 2, num_positions)


class SimulatedAcceptance:
    """Replaces `target_service.runner.verify.accepted_lengths` in this process (drawn on the host,
    one small copy to the device)."""

    def __init__(self, mean: float, seed: int, curve: str = "poisson", num_positions: int = 15):
        import target_service.runner.verify as verify_module

        if curve not in CURVES:
            raise ValueError(f"acceptance curve {curve!r}: expected one of {', '.join(CURVES)}")
        self.module, self.original = verify_module, verify_module.accepted_lengths
        self.curve = curve
        self.rate = max(mean - 1.0, 0.0)
        self.rates = None if curve == "poisson" else torch.tensor(solve_rates(curve, mean, num_positions))
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self, count: int) -> torch.Tensor:
        """Accepted drafts for `count` sequences were every one of K verified [count] int64 (capped by
        each one's draft count on the device, so nothing here waits for the GPU)."""
        if self.rates is None:
            return torch.poisson(torch.full((count,), self.rate), generator=self.generator).to(torch.int64)
        accepted = torch.rand(count, self.rates.shape[0], generator=self.generator) < self.rates
        return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # drafts up to the first rejection

    def __call__(self, drafts, targets, owners, columns, num_drafts: torch.Tensor) -> torch.Tensor:
        drawn = self.draw(num_drafts.shape[0]).tolist()
        return torch.minimum(to_device(drawn, torch.int64, num_drafts.device), num_drafts)

    def __enter__(self):
        self.module.accepted_lengths = self
        return self

    def __exit__(self, *exc):
        self.module.accepted_lengths = self.original
