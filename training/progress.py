"""A progress bar for long training loops, drawn through `logging` (no prints in library code).

A line every `every_seconds` (and at the end) carries a bar, the step, the percentage, the
values the loop reports (loss, lr, ...), the rate and an ETA.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressBar:
    def __init__(self, what: str, total: int, *, start: int = 0, every_seconds: float = 10.0,
                 width: int = 24):
        self.what, self.total, self.start, self.width = what, max(total, 1), start, width
        self.every = every_seconds
        self.began = self.last = time.monotonic()

    def line(self, step: int, **values: float) -> str:
        done = min(step / self.total, 1.0)
        elapsed = time.monotonic() - self.began
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else 0.0
        bar = "#" * int(done * self.width) + "." * (self.width - int(done * self.width))
        fields = " ".join(f"{name} {value:.4g}" for name, value in values.items())
        return (f"{self.what} [{bar}] {step}/{self.total} {100 * done:3.0f}% {fields} "
                f"{rate:.2f} it/s eta {_clock(eta)}")

    def update(self, step: int, *, force: bool = False, **values: float) -> None:
        """Report after `step` steps when a period has passed (always at the end or when forced)."""
        now = time.monotonic()
        if force or step >= self.total or now - self.last >= self.every:
            logger.info("%s", self.line(step, **values))
            self.last = now
