"""CUDA graphs of the target's forward for the steady state: every sequence decoding the same rows.

A step with no prefill chunk whose sequences all verify q_len rows (K drafts + the bonus, or 1 row
without a drafter) is replayed from a graph captured at the next batch size up, instead of launching
the forward's ~2,000 kernels from Python one by one. Anything else (prefills, mixed draft counts,
batches past the largest size) runs eagerly; the result is the same either way.

Static inputs live at the largest captured batch and are filled by `copy_` into their leading rows
(never rebound: the graphs read their addresses). A batch of B is padded to the captured size P
with P - B dummy sequences that keep the shape uniform: each verifies its own q_len rows at
positions 0..q_len-1 over page 0 and stores nothing (slot PAD_SLOT), so it reads valid memory and
writes none; its outputs are dropped. Graphs are captured largest first into one memory pool.

`capture=False` builds the same static batches and padding but runs them eagerly: on a CPU that is
how the padding is tested against the unpadded forward.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from foundation.graph_capture import collector_held
from kernels import PAD_SLOT
from kernels.linear import for_graphs
from target_service.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class GraphKey:
    """The shape family of a step: rows per sequence, and whether the drafter's taps are read."""

    q_len: int
    taps: bool


class _StaticInputs:
    """One key's input buffers at the largest batch; a graph of batch P reads their first P rows."""

    def __init__(self, key: GraphKey, max_batch: int, max_blocks: int, device: torch.device):
        rows, q = max_batch * key.q_len, key.q_len
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.dummy_positions = torch.arange(q, device=device).repeat(max_batch)  # 0..q-1 per sequence
        self.positions = self.dummy_positions.clone()
        self.slot_mapping = torch.full((rows,), PAD_SLOT, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((max_batch,), q, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, rows + 1, q, dtype=torch.int32, device=device)
        self.rows = torch.arange(rows, dtype=torch.int64, device=device)

    def batch(self, key: GraphKey, size: int) -> ForwardBatch:
        rows = size * key.q_len
        return ForwardBatch(
            input_ids=self.input_ids[:rows], positions=self.positions[:rows],
            slot_mapping=self.slot_mapping[:rows], block_table=self.block_table[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            logits_indices=self.rows[:rows], tap_indices=self.rows[:rows] if key.taps else self.rows[:0],
        )

    def fill(self, batch: ForwardBatch, key: GraphKey, padded: int) -> None:
        """Real rows from `batch`, then the dummy sequences up to `padded` made harmless."""
        size, rows, q = batch.num_seqs, batch.num_tokens, key.q_len
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.slot_mapping[:rows].copy_(batch.slot_mapping)
        self.block_table[:size, :batch.block_table.shape[1]].copy_(batch.block_table)
        self.seq_lens[:size].copy_(batch.seq_lens)
        if padded > size:  # dummy sequences: own rows only, over page 0, storing nothing
            self.slot_mapping[rows:padded * q].fill_(PAD_SLOT)
            self.positions[rows:padded * q].copy_(self.dummy_positions[rows:padded * q])
            self.seq_lens[size:padded].fill_(q)
            self.block_table[size:padded, 0].zero_()


class TargetGraphs:
    """Graphs of `model(batch, caches)` per (GraphKey, batch size); `run` replays the best fit."""

    def __init__(self, model, caches, *, sizes: list[int], keys: list[GraphKey], max_blocks_per_seq: int,
                 device: torch.device, capture: bool = True):
        self.model, self.caches, self.sizes, self.keys = model, caches, sorted(sizes), keys
        self.capturing = capture
        self.inputs = {key: _StaticInputs(key, self.sizes[-1], max_blocks_per_seq, device) for key in keys}
        self.graphs: dict[tuple[GraphKey, int], tuple[torch.cuda.CUDAGraph, object]] = {}
        self.replays = 0  # steps served from a graph (what the tests and benchmarks check)

    def capture(self) -> TargetGraphs:
        """Warm each shape up eagerly (kernel compilation, allocator), then capture it, largest first."""
        if not self.capturing:
            return self
        pool = torch.cuda.graph_pool_handle()
        with collector_held(), for_graphs():
            for key in self.keys:
                for size in reversed(self.sizes):
                    batch = self.inputs[key].batch(key, size)
                    self.model(batch, self.caches)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        output = self.model(batch, self.caches)
                    self.graphs[(key, size)] = (graph, output)
        logger.info("captured %d target graphs (sizes %s, q_len %s)", len(self.graphs), self.sizes,
                    [key.q_len for key in self.keys])
        return self

    def padded_size(self, num_seqs: int) -> int | None:
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def run(self, batch: ForwardBatch, key: GraphKey):
        """The forward of a uniform batch (every sequence `key.q_len` rows, logits and, with taps, taps
        of every row) from a graph; None when no graph fits (the caller runs it eagerly)."""
        padded = self.padded_size(batch.num_seqs)
        if key not in self.inputs or padded is None or batch.num_tokens != batch.num_seqs * key.q_len:
            return None
        inputs = self.inputs[key]
        inputs.fill(batch, key, padded)
        if self.capturing:
            graph, output = self.graphs[(key, padded)]
            graph.replay()
            self.replays += 1
        else:
            output = self.model(inputs.batch(key, padded), self.caches)
        rows = batch.num_tokens
        return type(output)(output.logits[:rows], output.taps[:rows])
