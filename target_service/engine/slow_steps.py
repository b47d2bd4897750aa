"""SlowSteps: the steps that kept running streams waiting longer than a threshold, counted and named.

A step's time, from one read to the next, is the gap every running stream of the replica sees between
two tokens. A gap over the threshold (250 ms: where a reader notices, and issue 31's bar) with no
compile behind it has a cause worth finding (a long prefill chunk beside the decodes, a first use of
something outside Triton, the host), so the engine counts such steps (`/metrics`) and logs what each
held: the decodes and the drafts they verified, the prefill chunks and their tokens. The log is
rate-limited (one line per `log_every_s`, with the count since the last), so a replica overloaded
by long prompts says so without flooding its log.

To hunt smaller stalls, an operator lowers the threshold and the interval without a code change:
`DFLASH_SLOW_STEP_MS` (default 250) and `DFLASH_SLOW_STEP_LOG_EVERY_S` (default 10; 0 logs every one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from foundation.environment import env_number
from foundation.gc_pauses import GcPauses
from target_service.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

SLOW_STEP_S = 0.25
LOG_EVERY_S = 10.0
THRESHOLD_VARIABLE, INTERVAL_VARIABLE = "DFLASH_SLOW_STEP_MS", "DFLASH_SLOW_STEP_LOG_EVERY_S"


def describe_step(plan: SchedulerOutput, verified: list[int]) -> str:
    """E.g. `8 decodes (15 drafts each), 2 prefill chunks (2,048 + 311 tokens, 1 starting past
    position 0)`: a chunk past position 0 continues its prompt, or starts after a prefix-cache hit."""
    drafts = sorted(set(verified))
    parts = []
    if plan.decodes:
        each = f"{drafts[0]} drafts each" if len(drafts) == 1 else f"{drafts[0]}-{drafts[-1]} drafts"
        parts.append(f"{len(plan.decodes)} decodes ({each})")
    if plan.prefills:
        tokens = " + ".join(f"{chunk.num_tokens:,}" for chunk in plan.prefills)
        resumed = sum(1 for chunk in plan.prefills if chunk.start > 0)
        parts.append(f"{len(plan.prefills)} prefill chunks ({tokens} tokens"
                     + (f", {resumed} starting past position 0" if resumed else "") + ")")
    return ", ".join(parts) or "nothing scheduled"


class SlowSteps:
    def __init__(self, threshold_s: float = SLOW_STEP_S, log_every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic, gc_pauses: GcPauses | None = None):
        """gc_pauses: whose collections a slow step's line reports (default: this process's)."""
        self.threshold_s, self.log_every_s, self.clock = threshold_s, log_every_s, clock
        self.gc_pauses = gc_pauses or GcPauses.shared()
        self.count = 0  # slow steps since start (the metric)
        self._unlogged = 0
        self._logged_at: float | None = None

    @classmethod
    def from_env(cls) -> SlowSteps:
        """The threshold and log interval the environment sets (`DFLASH_SLOW_STEP_MS`,
        `DFLASH_SLOW_STEP_LOG_EVERY_S`), else the defaults."""
        threshold_ms = env_number(THRESHOLD_VARIABLE, 1e3 * SLOW_STEP_S)
        return cls(threshold_ms / 1e3, env_number(INTERVAL_VARIABLE, LOG_EVERY_S))

    def observe(self, seconds: float, plan: SchedulerOutput, verified: list[int]) -> None:
        """One step that had decodes took `seconds` since the step before it was read."""
        if seconds <= self.threshold_s:
            return
        self.count += 1
        self._unlogged += 1
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < self.log_every_s:
            return
        more = f" ({self._unlogged - 1} more since the last report)" if self._unlogged > 1 else ""
        collecting, generation = self.gc_pauses.within(seconds)
        gc_part = (f" (garbage collection {1e3 * collecting:.0f} ms of it, up to generation {generation})"
                   if generation >= 0 else "")
        logger.warning("a step kept the running streams waiting %.0f ms%s: %s%s", 1e3 * seconds, gc_part,
                       describe_step(plan, verified), more)
        self._logged_at, self._unlogged = now, 0
