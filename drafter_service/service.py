"""DrafterService: the drafter service in a process of its own (a Ray actor beside the pool's).

It loads the DFlash model and the target's embedding and lm_head once, then serves whichever target
attaches it: `attach` maps the pool (its draft spec layers) and the target's step buffers by handle
and answers the target's per-step calls on the shared-memory step channel, in a thread of its own,
until the next `attach` or `close`. Per step nothing but a few ints crosses the channel; Ray only
starts, places, restarts and re-attaches this process.

After a crash Ray starts a new process with the same arguments; it holds no attachment until the
target, which noticed the crash on the channel, calls `attach` again.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from drafter_service.assembler import DrafterArgs, DrafterAssembler
from drafter_service.channel_control import serve_draft_worker
from drafter_service.step_buffers import StepBuffersHandle
from foundation.gc_pauses import freeze_startup_heap
from foundation.step_channel import StepChannel, StepChannelHandle
from kernels.compile_watch import WATCH, CompileCounts
from kvpool_service.memory import PoolHandle

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class DrafterService:
    def __init__(self, args: DrafterArgs):
        self.args = args
        WATCH.install()  # what compiles from here on: ready once the first attach has captured graphs
        self.assembler = DrafterAssembler(args).load()
        self._channel: StepChannel | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    @property
    def block_size(self) -> int:
        return self.assembler.block_size

    def describe(self) -> dict:
        """Who this is: the pid (the channel's liveness check) and the block size the target checks."""
        return {"pid": os.getpid(), "block_size": self.block_size}

    def attach(self, pool_handle: PoolHandle, step_handle: StepBuffersHandle,
               channel_handle: StepChannelHandle) -> int:
        """Serve the target behind these handles (dropping any previous one); returns this pid."""
        self._detach()
        worker = self.assembler.build(pool_handle, step_handle)
        self._channel = StepChannel.attach(channel_handle)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(worker, self._channel, self._stop),
                                        name="dflash-drafter-channel", daemon=True)
        self._thread.start()
        logger.info("drafter (pid %d) attached to pool epoch %d", os.getpid(), pool_handle.layout.epoch)
        WATCH.mark_ready()
        freeze_startup_heap()  # the drafter's loop holds the GIL; a long collection would stall the step
        return os.getpid()

    def compilations(self) -> CompileCounts:
        """Triton kernels this process built: at start-up and the first attach, and since."""
        return WATCH.counts()

    def is_serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        self._detach()
        self.assembler.close()

    def _serve(self, worker, channel: StepChannel, stop: threading.Event) -> None:
        try:
            device = torch.device(self.args.device)
            if device.type == "cuda":  # set_device needs an index; "cuda" alone means the current one
                index = device.index if device.index is not None else torch.cuda.current_device()
                torch.cuda.set_device(index)
            serve_draft_worker(worker, channel, stop.is_set)
        except BaseException as error:
            logger.exception("the drafter's channel loop stopped")
            self._error = error
            channel.close()  # the target sees the channel closed (PeerGone) instead of waiting on it

    def _detach(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(STOP_TIMEOUT_S)
            self._thread = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
