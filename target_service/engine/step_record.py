"""StepRecord: how the engine's steps went, counted as each step is read, and each step's time;
EngineCounters: what the engine reports of them (with its own counts), since it started.

A step's time is the time from one read to the next: what every running stream waited between two
tokens. It is the step's own cost only when the step followed the one before it without an idle gap
(`went_idle` marks one), and it is a verify's cost only when the step only decoded, every sequence
verifying one k (a prefill chunk's time is not a verify's). Such times are what adaptive speculation
and the hybrid proposer learn a step's cost from; any step with decodes that took too long is a gap
its streams saw, which `SlowSteps` counts and names.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from target_service.engine.scheduler_output import SchedulerOutput
from target_service.engine.slow_steps import SlowSteps


@dataclass(frozen=True)
class EngineCounters:
    """How the engine's steps went, since it started."""

    num_steps: int  # steps read
    num_steps_ahead: int  # ... of which launched before the step before them was read
    num_dropped_ahead: int  # sequences whose step ahead was dropped (they finished the step before)
    num_preemptions: int  # sequences preempted (recompute), pool restarts included
    num_pool_recoveries: int  # steps that found the pool gone and moved onto its restarted self
    # steps by the tokens they gave back (vLLM's iteration tokens): the prompt of each request whose
    # first token came in the step, plus every token the step emitted
    iteration_tokens: dict[int, int] = field(default_factory=dict)
    # decode-only steps by the drafts each sequence verified (adaptive speculation's choices show here)
    decode_steps_by_drafts: dict[int, int] = field(default_factory=dict)
    num_slow_steps: int = 0  # steps that kept running streams waiting over the slow-step threshold


class StepRecord:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.num_steps = 0  # steps read
        # steps by the tokens they gave back (vLLM's iteration tokens; see `gave_back`)
        self.iteration_tokens: Counter[int] = Counter()
        # decode-only steps by the drafts each sequence verified (adaptive speculation's choices show here)
        self.decode_steps_by_drafts: Counter[int] = Counter()
        self.slow_steps = SlowSteps.from_env()
        self._last_read: float | None = None  # when the step before was read, if it ran back to back

    def read(self, plan: SchedulerOutput, verified: list[int]) -> float | None:
        """A step was read (`verified`: the drafts each of its decodes verified). Returns its time when
        it is a verify's cost (above), else None."""
        now = self.clock()
        previous, self._last_read = self._last_read, now
        self.num_steps += 1
        if previous is not None and plan.decodes:
            self.slow_steps.observe(now - previous, plan, verified)
        if plan.prefills or len(set(verified)) != 1:
            return None
        self.decode_steps_by_drafts[verified[0]] += 1
        return None if previous is None else now - previous

    def gave_back(self, tokens: int) -> None:
        """A step gave back `tokens` (each token emitted, plus the prompt of each request whose first
        token came in it)."""
        self.iteration_tokens[tokens] += 1

    def went_idle(self) -> None:
        """Nothing is left to run: the next step begins after an idle gap, which is not its time."""
        self._last_read = None
