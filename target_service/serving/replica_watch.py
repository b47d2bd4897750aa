"""Replica faults in the foreground: `dflash serve` says when a replica stops and when the set is whole
again, with Ray Serve's reason and where the replica's own log is.

Replicas log to Ray's session files, not to the command's terminal (streamed worker output would
bring every Ray and Serve line with it), so without this a replica that crashed was visible only as
a minute of 503s. `ReplicaWatch` turns successive counts of running replicas into those lines (no
Ray needed to test it); `watch_replicas` polls Ray Serve's status for it on a thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

POLL_S = 2.0


@dataclass(frozen=True)
class ReplicaCounts:
    """One look at the deployment: replicas running, replicas wanted, and Serve's message."""

    running: int
    wanted: int
    message: str = ""


class ReplicaWatch:
    """Says what changed since the last look: replicas lost (with the reason) or the set whole again."""

    def __init__(self, wanted: int, log_hint: str):
        self.log_hint = log_hint
        self.last = ReplicaCounts(wanted, wanted)

    def observe(self, now: ReplicaCounts) -> str | None:
        last, self.last = self.last, now
        if now.running < last.running:
            lost = last.running - now.running
            lines = now.message.strip().splitlines()
            reason = lines[0] if lines else "Ray Serve gave no reason"
            return (f"dflash serve: {lost} replica(s) stopped, {now.running} of {now.wanted} running "
                    f"({reason}); Ray Serve is starting a replacement; the replica's own log: "
                    f"{self.log_hint}")
        if now.running >= now.wanted > last.running:
            return f"dflash serve: all {now.wanted} replica(s) running again"
        return None


def watch_replicas(look: Callable[[], ReplicaCounts | None], watch: ReplicaWatch, stop: threading.Event,
                   say: Callable[[str], None], poll_s: float = POLL_S) -> threading.Thread:
    """Look every `poll_s` until `stop` is set, saying each change; a look that fails is skipped."""

    def run():
        while not stop.wait(poll_s):
            try:
                counts = look()
            except Exception as error:  # Ray busy or going away: the next look may answer
                logger.debug("replica status: %s", error)
                continue
            line = None if counts is None else watch.observe(counts)
            if line:
                say(line)

    thread = threading.Thread(target=run, name="dflash-replica-watch", daemon=True)
    thread.start()
    return thread
