"""Training checkpoints: everything a run needs to continue exactly where it stopped.

One file, `<out>/checkpoints/last.pt`: model and optimizer state, the step, the data generator's
state and the arguments the run started with. It is written to a temporary file and renamed, so a
run killed mid-write leaves the previous checkpoint intact. `--resume` refuses a checkpoint whose
arguments differ from the new run's in anything that changes the result (sizes, data, lr, steps).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAST = "last.pt"


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run (missing, or made with different arguments)."""


def checkpoint_path(out: str | Path) -> Path:
    return Path(out) / CHECKPOINT_DIR / LAST


def save_state(out: str | Path, *, model: torch.nn.Module, optimizer, schedule, step: int,
               generator: torch.Generator, args: dict[str, Any], history: list) -> Path:
    """history: the (step, loss, ...) records so far, so a resumed run reports the whole curve."""
    path = checkpoint_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "schedule": schedule.state_dict(), "step": step, "generator": generator.get_state(),
             "args": args, "history": history}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    logger.info("checkpoint: step %d -> %s", step, path)
    return path


def load_state(out: str | Path, *, model: torch.nn.Module, optimizer, schedule, generator: torch.Generator,
               args: dict[str, Any], ignore: tuple[str, ...] = ()) -> tuple[int, list]:
    """Restore model, optimizer, schedule and generator in place; return (step, history)."""
    path = checkpoint_path(out)
    if not path.is_file():
        raise ResumeError(f"--resume: no checkpoint at {path}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved = state["args"]
    changed = sorted(key for key in set(saved) | set(args)
                     if key not in ignore and saved.get(key) != args.get(key))
    if changed:
        detail = ", ".join(f"{key}: {saved.get(key)!r} -> {args.get(key)!r}" for key in changed[:4])
        raise ResumeError(f"--resume: {path} was made with different arguments ({detail})")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    generator.set_state(state["generator"])
    logger.info("resuming from step %d (%s)", state["step"], path)
    return int(state["step"]), list(state["history"])
