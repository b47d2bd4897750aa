"""AdamW with linear warmup and cosine decay, the recipe both commands use.

Weight decay applies to matrices only (norm weights are scales around 1, decaying them toward 0
would fight the normalisation). The schedule is a pure function of the step, so a resumed run
continues on exactly the curve it left.
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr at `step`: (step+1)/warmup while warming up, then a cosine to min_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupCosine:
    """The schedule as an object, so its horizon can be fixed once a time budget has measured the
    step rate (`total_steps` is plain state: LambdaLR checkpoints it with the rest)."""

    def __init__(self, total_steps: int, warmup_steps: int):
        self.total_steps, self.warmup_steps = total_steps, warmup_steps

    def __call__(self, step: int) -> float:
        return lr_factor(step, total_steps=self.total_steps, warmup_steps=self.warmup_steps)


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, total_steps: int,
                   warmup_steps: int, fused: bool = False):
    """(AdamW, LambdaLR) over the trainable parameters of `model`."""
    if lr <= 0 or total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need lr > 0, total_steps >= 1 and 0 <= warmup_steps <= total_steps; got lr={lr}, "
                         f"total_steps={total_steps}, warmup_steps={warmup_steps}")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(total_steps, warmup_steps))
    return optimizer, schedule
