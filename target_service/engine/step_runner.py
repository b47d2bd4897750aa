"""What the engine asks of the device: the `StepRunner` protocol (`runner.ModelRunner` satisfies it).

The engine keeps the books (who runs, what was accepted, what is committed); the runner does the
device work. They meet here, so the engine can be tested with a fake runner and the runner by
feeding it a `SchedulerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from target_service.engine.outputs import TokenLogprob
from target_service.engine.scheduler_output import SchedulerOutput


class LaunchedStep(Protocol):
    """A step queued on the device: the plan it runs and how many drafts each decode verifies."""

    plan: SchedulerOutput
    verified: list[int]  # drafts verified per decode, in plan order
    max_accepted: list[int] | None  # ... of which may count; None: decided on the device (a step ahead)
    failed: dict[int, Exception]  # seq_id -> why that sequence's own part of the step failed
    proposers: list[str | None]  # per decode: who drafted ("dflash", "ngram"); None: no drafts


@dataclass(frozen=True)
class StepTokens:
    """A launched step's results on the host, per scheduled sequence in plan order.

    The logprobs lists are empty when no request of the step asked; an entry is None for a sequence
    that did not ask.
    """

    decode_tokens: list[list[int]]  # per decode: the target's token at each of its logits rows
    accepted: list[int]  # per decode: drafts accepted
    prefill_tokens: list[list[int]]  # per prefill chunk: the target's token at its logits row, if any
    decode_logprobs: list[list[TokenLogprob] | None] = ()  # per decode: those tokens' logprobs
    prefill_logprobs: list[list[TokenLogprob] | None] = ()  # per prefill chunk: the same
    # per prefill chunk: the logprobs of the prompt tokens after its `prompt_logprob_positions`
    prompt_logprobs: list[list[TokenLogprob] | None] = ()


class StepRunner(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def num_steps_ahead(self) -> int:
        """Steps launched from the device results of the step before them, so far."""
        ...

    def make_generator(self, seed: int):
        """A random generator of a request's own, where its tokens are sampled."""
        ...

    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """Queue the step `plan` schedules; nothing is read back yet."""
        ...

    def launch_after(self, current: LaunchedStep, plan: SchedulerOutput) -> LaunchedStep | None:
        """Queue `plan` (`Scheduler.schedule_ahead`) from `current`'s device results; None when it
        cannot be launched (the step is then scheduled as usual)."""
        ...

    def read(self, launched: LaunchedStep) -> StepTokens:
        """Wait for a launched step's results."""
        ...

    def step_took(self, launched: LaunchedStep, seconds: float) -> None:
        """`launched`, read, only decoded, every sequence verified one count of drafts, and it began
        as the step before it was read: its time, for a proposer that weighs what steps cost."""
        ...
