"""CUDA graphs of the drafter's block forward: the noise block of B sequences, lm_head and argmax.

The propose side of the step buffers already has fixed shapes and addresses, so a graph captured
at batch P reads its first P rows of every field (the whole block table) and writes the first P rows
of `draft_tokens`. A batch of B is padded to the next captured P; the P - B dummy rows get a start
position of 0, so their context is empty (they attend to their own noise block only) and their
drafts are never read. The context store has graphs of its own (`drafter_service.context_graphs`).

`capture=False` runs the same padded forward eagerly, which is how a CPU tests the padding.
"""

from __future__ import annotations

import bisect
import logging

import torch

from foundation.graph_capture import collector_held
from kernels.linear import for_graphs

logger = logging.getLogger(__name__)


class PaddedGraphs:
    """CUDA graphs of one fixed-shape forward per size over static buffers; a count is padded to the
    next captured size, its padding rows made harmless by `_pad`. Subclasses say what runs (`_forward`)
    and what a dummy row is (`_pad`). `capture=False` runs the padded forward eagerly (CPU tests)."""

    what: str  # for the log lines

    def __init__(self, worker, sizes: list[int], *, capture: bool = True):
        self.worker, self.sizes, self.capturing = worker, sorted(sizes), capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def capture(self):
        """Warm each size up eagerly over dummy rows, then capture it, largest first, in one memory
        pool. A capture the device refuses leaves no graph: every count then runs eagerly (the same
        results, more host time), with a warning that says why."""
        if not self.capturing or not self.sizes:
            return self
        device = self.worker.buffers.taps.device
        if device.type != "cuda":  # a capture of CPU work is an empty graph: replays would do nothing
            logger.warning("%s graphs not captured (buffers on %s); they run eagerly", self.what, device)
            self.sizes = []
            return self
        try:
            pool = torch.cuda.graph_pool_handle()
            with collector_held(), for_graphs():
                for size in reversed(self.sizes):
                    self._pad(0, size)
                    self._forward(size)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._forward(size)
                    self.graphs[size] = graph
        except RuntimeError as error:
            logger.warning("%s graphs not captured (%s); they run eagerly", self.what, error)
            self.graphs.clear()
            self.sizes = []
            return self
        logger.info("captured %d %s graphs (sizes %s)", len(self.graphs), self.what, self.sizes)
        return self

    def run(self, count: int) -> bool:
        """Run the forward for the first `count` rows from a graph; False when none is large enough."""
        index = bisect.bisect_left(self.sizes, count)
        if index == len(self.sizes):
            return False
        padded = self.sizes[index]
        if count < padded:
            self._pad(count, padded)
        if self.capturing:
            self.graphs[padded].replay()
            self.replays += 1
        else:
            self._forward(padded)
        return True

    def _pad(self, start: int, end: int) -> None:
        raise NotImplementedError

    def _forward(self, size: int) -> None:
        raise NotImplementedError


class ProposeGraphs(PaddedGraphs):
    """The block forward per batch size; dummy sequences start at position 0 (an empty context)."""

    what = "drafter"

    def __init__(self, worker, sizes: list[int], *, capture: bool = True):
        super().__init__(worker, sizes, capture=capture)
        self.columns = worker.buffers.layout.max_blocks_per_seq

    def _pad(self, start: int, end: int) -> None:
        self.worker.buffers.start_positions[start:end].zero_()

    def _forward(self, size: int) -> None:
        self.worker.draft_rows(size, self.columns)
