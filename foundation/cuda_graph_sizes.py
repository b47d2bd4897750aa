"""The batch sizes both services capture CUDA graphs at: every size 1-8 (where latency matters most
and padding would waste most), then coarser steps to 64. A batch replays the next size up."""

from __future__ import annotations

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """The batch sizes to capture: `sizes` (or the defaults) up to max_num_seqs, ascending."""
    chosen = sorted({size for size in (sizes or DEFAULT_SIZES) if 1 <= size <= max_num_seqs})
    if not chosen:
        raise ValueError(f"cuda_graph_sizes: none of {list(sizes or DEFAULT_SIZES)} is in 1..max_num_seqs "
                         f"= {max_num_seqs}")
    return chosen
