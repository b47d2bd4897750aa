"""The optimisation loop both `train` commands share: step, clip, schedule, report, checkpoint, resume.

The caller supplies `loss_fn(generator) -> (loss, metrics)`, which draws its own batch from the
data generator; everything a resumed run needs (model, optimizer, schedule, generator, history) is
checkpointed together, so `--resume` continues the same trajectory, batch for batch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.progress import ProgressBar
from training.state import load_state, save_state

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSettings:
    """stop_after: end this invocation early (resume later); time_budget: seconds of training,
    turned into a step count (at most the schedule's) once the step rate is measured."""

    save_every: int = 500
    log_every: int = 50
    grad_clip: float = 1.0
    stop_after: int | None = None
    resume: bool = False
    time_budget: float | None = None


# arguments that do not change the trajectory: how far this invocation goes, and the export format
RESUME_MAY_CHANGE = ("stop_after", "resume", "save_dtype", "max_shard_size")
PROBE = (5, 25)  # steps timed to fit a time budget (after the first ones: allocator, kernel warm-up)


def _fit_budget(schedule, step_rate: float, budget: float, elapsed: float) -> int:
    """Shorten the schedule to the steps that fit `budget` seconds at `step_rate`; return the new total."""
    horizon = schedule.lr_lambdas[0]
    fitted = int(PROBE[1] + step_rate * max(budget - elapsed, 0.0))
    horizon.total_steps = max(min(horizon.total_steps, fitted), PROBE[1] + 1, horizon.warmup_steps + 1)
    logger.info("time budget %.0f s at %.2f steps/s: %d steps", budget, step_rate, horizon.total_steps)
    return horizon.total_steps


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master weights in the optimizer); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_loop(what: str, out: str | Path, model: torch.nn.Module, loss_fn: Callable, optimizer, schedule,
               generator: torch.Generator, run_args: dict[str, Any], settings: LoopSettings,
               device: torch.device) -> tuple[int, list[dict], int]:
    """Run the schedule to its end (or `stop_after`); return (step reached, loss history, total steps)."""
    step, history = 0, []
    if settings.resume:
        step, history = load_state(out, model=model, optimizer=optimizer, schedule=schedule,
                                   generator=generator, args=run_args, ignore=RESUME_MAY_CHANGE)
    total = schedule.lr_lambdas[0].total_steps  # a resumed run keeps the horizon it had fixed
    end = min(total, settings.stop_after or total)
    bar = ProgressBar(what, total, start=step)
    began, probe_start = time.monotonic(), None
    sums: dict[str, torch.Tensor] = {}  # summed on the device: no host sync until a report
    count = 0
    model.train()
    while step < end:
        with autocast(device):
            loss, metrics = loss_fn(generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        schedule.step()
        step += 1
        if settings.time_budget and not settings.resume and step in PROBE:
            _sync(device)
            if step == PROBE[0]:
                probe_start = time.monotonic()
            else:
                rate = (PROBE[1] - PROBE[0]) / (time.monotonic() - probe_start)
                total = _fit_budget(schedule, rate, settings.time_budget, time.monotonic() - began)
                end = min(total, settings.stop_after or total)
                bar.total = total
        values = {"loss": loss, "grad_norm": norm, **metrics}
        for name, value in values.items():
            sums[name] = sums.get(name, 0.0) + value.detach().float()
        count += 1
        if step % settings.log_every == 0 or step == end:
            means = {name: float(total) / count for name, total in sums.items()}
            record = {"step": step, "lr": schedule.get_last_lr()[0], **means}
            history.append(record)
            sums, count = {}, 0
            bar.update(step, **{k: v for k, v in record.items() if k != "step"})
        if step % settings.save_every == 0 or step == end:
            save_state(out, model=model, optimizer=optimizer, schedule=schedule, step=step,
                       generator=generator, args=run_args, history=history)
    model.eval()
    return step, history, total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
