"""CUDA graphs of the drafter's context store: the context projection of a step's tap rows.

Every row the target ran this step is a context row (a rejected draft's row carries PAD_SLOT and is
not stored), so in the steady state a step of B sequences verifying K drafts stores B x (K + 1) rows:
the same count step after step. Eagerly the projection is ~20 small kernels (the fc and K/V GEMMs,
the norm, and each draft layer's key norm + RoPE and store) launched one by one with their Python
checks, the largest host cost of a step (`bench/results/step_host_h200.md`); in the split it is on
the drafter's host, which the target waits for. A graph per row count replays them in one launch.

The context side of the step buffers has fixed addresses, so a graph captured at P rows reads the
first P rows of taps, positions, sequence slots and pool slots. N rows are padded to the next
captured P: rows N..P-1 get PAD_SLOT (nothing stored), position 0 and slot 0, so whatever their
taps hold they only cost arithmetic. The sizes are the batch sizes the propose graphs capture times
the block size (the row counts of uniform steps at K = block_size - 1; a smaller K pads up), capped at
MAX_ROWS so the graphs' activations stay small beside the pool. Prefill chunks, and anything larger,
run eagerly.

`capture=False` runs the same padded store eagerly, which is how a CPU tests the padding.
"""

from __future__ import annotations

import bisect
import logging

import torch

from kernels import PAD_SLOT

logger = logging.getLogger(__name__)

MAX_ROWS = 1024  # 64 sequences x 16 rows; ~50 MB of bf16 activations at Qwen3-8B's drafter widths


def context_row_sizes(batch_sizes: list[int], block_size: int, max_rows: int) -> list[int]:
    """Row counts to capture: each batch size's B x block_size, up to min(max_rows, MAX_ROWS)."""
    limit = min(max_rows, MAX_ROWS)
    return sorted({size * block_size for size in batch_sizes if size * block_size <= limit})


class ContextGraphs:
    def __init__(self, worker, sizes: list[int], *, capture: bool = True):
        self.worker, self.sizes, self.capturing = worker, sorted(sizes), capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def capture(self) -> ContextGraphs:
        """Warm each size up eagerly over dummy rows (nothing is stored), then capture it, largest
        first, in one memory pool. A capture the device refuses leaves no graph: the store runs
        eagerly (slower on the host, the same pages), with a warning that says why."""
        if not self.capturing or not self.sizes:
            return self
        try:
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):
                self._pad(0, size)
                self.worker.store_rows(size)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.worker.store_rows(size)
                self.graphs[size] = graph
        except RuntimeError as error:
            logger.warning("context graphs not captured (%s); the context store runs eagerly", error)
            self.graphs.clear()
            self.sizes = []
            return self
        logger.info("captured %d context graphs (rows %s)", len(self.graphs), self.sizes)
        return self

    def run(self, num_rows: int) -> bool:
        """Store the first num_rows context rows from a graph; False when none is large enough."""
        index = bisect.bisect_left(self.sizes, num_rows)
        if index == len(self.sizes):
            return False
        padded = self.sizes[index]
        self._pad(num_rows, padded)
        if self.capturing:
            self.graphs[padded].replay()
            self.replays += 1
        else:
            self.worker.store_rows(padded)
        return True

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end-1 become dummies: stored nowhere, at position 0 of slot 0."""
        if start < end:
            buffers = self.worker.buffers
            buffers.context_slots[start:end].fill_(PAD_SLOT)
            buffers.context_positions[start:end].zero_()
            buffers.context_seq_slots[start:end].zero_()
