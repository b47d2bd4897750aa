"""DrafterLink: the target's DraftControl to a drafter in another process that may die and come back.

Calls go through the shared-memory step channel (`ChannelDraftControl`). When the drafter's process
is gone (the channel sees its lock released) or stops answering, the call raises `DrafterUnavailable`:
the engine finishes that step without speculation and its sequences decode plainly (lossless either
way). At the same moment the link asks for the drafter to be attached again (`reattach`, which
returns a future: Ray queues the call until the restarted actor is up) and, from then on, checks
that future without waiting at the start of each call; once it resolves, speculation resumes for
new (and recomputed) sequences. A drafter that dies at any moment (mid-call, between calls, while
being attached) or never comes back costs speculation only, never a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from drafter_service.control import DrafterUnavailable
from foundation.step_channel import PeerGone

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 0.5  # a failed re-attach (the actor was not restarted yet) is asked for again after this


class DrafterLink:
    def __init__(self, control, reattach: Callable[[], Future], *, block_size: int,
                 clock: Callable[[], float] = time.monotonic):
        """control: a ChannelDraftControl; reattach: asks the drafter to attach to our buffers again."""
        self.clock = clock
        self.control = control
        self.reattach = reattach
        self._block_size = block_size
        self.available = True
        self.num_failures = 0
        self.num_reattached = 0
        self._pending: Future | None = None
        self._retry_at = 0.0

    @property
    def block_size(self) -> int:
        return self._block_size

    def store_context(self, num_rows: int) -> None:
        self._call(self.control.store_context, num_rows)

    def settle(self) -> None:
        self._call(self.control.settle)

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        self._call(self.control.propose, num_seqs, num_draft, num_block_cols)

    def _call(self, method, *args) -> None:
        if not self.available and not self._poll():
            raise DrafterUnavailable("the drafter is restarting")
        try:
            method(*args)
        except (PeerGone, TimeoutError) as error:
            self._lose(error)
            raise DrafterUnavailable(str(error)) from error

    def attach_again(self, timeout_s: float) -> bool:
        """Attach the drafter anew and wait for it (the pool moved: the context lives in the new pool's
        pages). One that cannot be attached now is unavailable until a later attempt succeeds, as after
        a death; returns whether it is attached."""
        self._ask()
        try:
            self._pending.result(timeout_s)
        except Exception as error:  # gone, restarting for longer than timeout_s, or its attach failed
            self._lose(error)
            return False
        self._pending, self.available = None, True
        return True

    def _lose(self, error: Exception) -> None:
        self.available = False
        self.num_failures += 1
        logger.warning("the drafter went away (%s); asking for it to be attached again", error)
        self._ask()

    def _ask(self) -> None:
        self._pending, self._retry_at = self.reattach(), 0.0

    def _poll(self) -> bool:
        """Whether a re-attach finished (without waiting for one that has not)."""
        if self._pending is None:
            if self.clock() < self._retry_at:
                return False
            self._ask()
        if not self._pending.done():
            return False
        try:
            self._pending.result()
        except Exception as error:  # not restarted yet, or the attach failed: ask again later
            logger.info("re-attaching the drafter failed (%s); retrying", error)
            self._pending, self._retry_at = None, self.clock() + RETRY_AFTER_S
            return False
        self._pending = None
        self.available = True
        self.num_reattached += 1
        logger.warning("the drafter is back; new sequences speculate again")
        return True
