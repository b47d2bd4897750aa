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

logger = logging.getLogger(__name__)


class ProposeGraphs:
    def __init__(self, worker, sizes: list[int], *, capture: bool = True):
        self.worker, self.sizes, self.capturing = worker, sorted(sizes), capture
        self.columns = worker.buffers.layout.max_blocks_per_seq
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def capture(self) -> ProposeGraphs:
        """Warm each size up eagerly, then capture it, largest first, in one memory pool."""
        if not self.capturing:
            return self
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.worker.buffers.start_positions[:size].zero_()
            self.worker.draft_rows(size, self.columns)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.worker.draft_rows(size, self.columns)
            self.graphs[size] = graph
        logger.info("captured %d drafter graphs (sizes %s)", len(self.graphs), self.sizes)
        return self

    def run(self, num_seqs: int) -> bool:
        """Draft the first num_seqs rows from a graph; False when none is large enough."""
        index = bisect.bisect_left(self.sizes, num_seqs)
        if index == len(self.sizes):
            return False
        padded = self.sizes[index]
        self.worker.buffers.start_positions[num_seqs:padded].zero_()  # dummies: empty context
        if self.capturing:
            self.graphs[padded].replay()
            self.replays += 1
        else:
            self.worker.draft_rows(padded, self.columns)
        return True
