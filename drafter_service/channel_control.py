"""ChannelDraftControl: `DraftControl` over a `StepChannel`, for a drafter in another process.

The target calls `store_context` and `propose` every step; each becomes one opcode and its row
counts on the channel (the step's data is already in the step buffers both sides map). The drafter's
process runs `serve_draft_worker`, which hands each opcode to its `DraftWorker`. A worker error goes
back as `RemoteError` text and the drafter keeps serving; a dead drafter is `PeerGone` on the target.
Neither side imports Ray: the actors only create the channel, pass its handle and call these.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum

from drafter_service.control import DraftControl
from foundation.step_channel import StepChannel


class DraftOp(IntEnum):
    PING = 1  # -> the drafter's block_size
    STORE_CONTEXT = 2  # (num_rows)
    PROPOSE = 3  # (num_seqs, num_draft, num_block_cols)


class ChannelDraftControl:
    """The target's side: each DraftControl call is one round trip on `channel` (its owner's end).

    timeout_s: how long a call may wait on a live drafter (None: as long as it lives; its first
    propose may compile kernels for a while).
    """

    def __init__(self, channel: StepChannel, block_size: int, *, timeout_s: float | None = None):
        self.channel = channel
        self._block_size = block_size
        self.timeout_s = timeout_s

    @property
    def block_size(self) -> int:
        return self._block_size

    def ping(self) -> int:
        """A liveness check: the drafter's block_size, as its worker reports it."""
        return self.channel.call(DraftOp.PING, timeout_s=self.timeout_s)

    def store_context(self, num_rows: int) -> None:
        """Posted, not awaited: the drafter writes the context while the target commits, schedules
        and stages the next step; the next propose waits for it (and raises its error)."""
        self.channel.post(DraftOp.STORE_CONTEXT, num_rows, timeout_s=self.timeout_s)

    def settle(self) -> None:
        self.channel.settle()

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        self.channel.call(DraftOp.PROPOSE, num_seqs, num_draft, num_block_cols, timeout_s=self.timeout_s)


def serve_draft_worker(worker: DraftControl, channel: StepChannel,
                       should_stop: Callable[[], bool] | None = None) -> None:
    """The drafter's side: answer the target's calls with `worker` (on the attached `channel`) until
    `should_stop()`; raises PeerGone when the target (the channel's owner) is gone."""

    def handle(opcode: int, args: tuple[int, ...]) -> int | None:
        op = DraftOp(opcode)  # ValueError, and so RemoteError on the target, for an unknown opcode
        if op is DraftOp.PING:
            return worker.block_size
        if op is DraftOp.STORE_CONTEXT:
            return worker.store_context(*args)
        return worker.propose(*args)

    channel.serve_forever(handle, should_stop)
