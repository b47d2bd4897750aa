"""CUDA graphs of the drafter's context store: the context projection of a step's tap rows.

Every row the target ran this step is a context row (a rejected draft's row carries PAD_SLOT and is
not stored), so in the steady state a step of B sequences verifying K drafts stores B x (K + 1) rows:
the same count step after step. Eagerly the projection is ~20 small kernels (the fc and K/V GEMMs,
the norm, and each draft layer's key norm + RoPE and store) launched one by one with their Python
checks, the largest host cost of a step (a cProfile of a graphed B 1 step on an H200); in the split it is on
the drafter's host, which the target waits for. A graph per row count replays them in one launch.

The context side of the step buffers has fixed addresses, so a graph captured at P rows reads the
first P rows of taps, positions, sequence indices and pool slots. N rows are padded to the next
captured P: rows N..P-1 get PAD_SLOT (nothing stored), position 0 and sequence index 0, so whatever their
taps hold they only cost arithmetic. The sizes are the batch sizes the propose graphs capture times
the block size (the row counts of uniform steps at K = block_size - 1; a smaller K pads up), capped at
MAX_ROWS so the graphs' activations stay small beside the pool, and `DEFERRED_STORE_ROWS`: a hybrid
proposer holds the context of lookup-only steps and hands over up to that many rows in one store
(`target_service.proposers.deferred_context`), at any count, which no batch size's B x block_size
covers past the largest batch. Eagerly each such store is the ~20 launches above, on a host that
sets the pace wherever the model is small (the demo pair on a GPU stores every fourth lookup-only step
of a batch of four at K 15). With this size captured the hybrid ran at 0.952 of ngram's tok/s, without
it 0.912, on a noisy H100 (bench/results/proposers_graph_store_h100.md). A prefill chunk's rows pad up
to a captured size like any others; more rows than the largest size run eagerly.

`capture=False` runs the same padded store eagerly, which is how a CPU tests the padding.
"""

from __future__ import annotations

from drafter_service.cuda_graphs import PaddedGraphs
from kernels import PAD_SLOT

MAX_ROWS = 1024  # 64 sequences x 16 rows; ~50 MB of bf16 activations at Qwen3-8B's drafter widths
DEFERRED_STORE_ROWS = 256  # the most rows a deferred store hands over: 16 steps of one sequence at K 15


def context_row_sizes(batch_sizes: list[int], block_size: int, max_rows: int) -> list[int]:
    """Row counts to capture: each batch size's B x block_size and DEFERRED_STORE_ROWS, up to
    min(max_rows, MAX_ROWS)."""
    limit = min(max_rows, MAX_ROWS)
    sizes = {size * block_size for size in batch_sizes} | {DEFERRED_STORE_ROWS}
    return sorted(size for size in sizes if size <= limit)


class ContextGraphs(PaddedGraphs):
    """The context store per row count; dummy rows are stored nowhere, at position 0 of sequence index 0."""

    what = "context"

    def _pad(self, start: int, end: int) -> None:
        buffers = self.worker.buffers
        buffers.context_slots[start:end].fill_(PAD_SLOT)
        buffers.context_positions[start:end].zero_()
        buffers.context_seq_indices[start:end].zero_()

    def _forward(self, size: int) -> None:
        self.worker.store_rows(size)
