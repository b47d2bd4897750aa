"""DeferredContext: context rows of lookup-only and prefill-only steps, kept on the device to be stored
together later.

A hybrid step that skips the DFlash drafter still has to keep the drafter's context whole (DFlash may
take over at any step), but nothing reads that context until the drafter next runs. Storing it then,
for several steps at once, reads the drafter's context weights once instead of once per step: on a
CPU the store of a lookup-only step cost about 12% of it (the demo pair, one sequence), and the
demo drafter stores 16 rows in 1.4 ms but 100 in 3.0 ms (2 threads), not 9.

The taps are copied into a buffer of this object's own straight from the step's selection,
without a trip through the step buffers (whose writes would first wait for the drafter): they are the
forward's output, which the next step overwrites. The positions, sequence indices and pool slots are
tensors the selection made for this step alone, so they are kept as they are and joined once, when
the rows are staged into the step buffers to be stored (one copy a step where there were four). Only
the owner decides when (`HybridProposer`): before the drafter reads the context, before a sequence's
pages are released (after that its slots may be another sequence's), and when the next step's rows
would not fit. `owners` are the sequences whose rows are held, so a store that the drafter misses can
mark their context as having a gap.

How many rows fit: up to `MAX_DEFERRED_ROWS`, as long as their taps take at most `MAX_DEFERRED_BYTES`,
and at most what the step buffers' context side stages at once. Room for 1,024 rows was tried (a batch
of four at K 15 stores every fourth lookup-only step on a GPU, where every row of a decode is held,
rejected drafts as PAD_SLOT): on an H100 its tok/s over ngram's was within the runs' noise of 256
rows', and on held-out code in one batch the hybrid's acceptance fell from 0.97-0.98 to 0.94 of the
per-prompt better proposer's in both rounds (bench/results/proposers_ab_h100.md). A drafter step
after a run of lookup-only steps first stores everything held, so its interval carries that store;
the likely cause (not shown): four times the rows made the drafter's step look dearer, and the
choice drafted less.
"""

from __future__ import annotations

import torch

from drafter_service.context_graphs import DEFERRED_STORE_ROWS
from drafter_service.step_buffers import StepBuffers
from target_service.engine.sequence import Sequence

MAX_DEFERRED_ROWS = DEFERRED_STORE_ROWS  # 16 steps of one sequence at K 15; its store replays a graph
MAX_DEFERRED_BYTES = 64 << 20  # of taps: 256 rows at Qwen3-8B's five taps of 4096 take 10 MB in bf16


class DeferredContext:
    def __init__(self, buffers: StepBuffers, capacity: int = MAX_DEFERRED_ROWS):
        taps = buffers.taps
        row_bytes = max(1, taps.shape[1] * taps.element_size())
        most = min(capacity, MAX_DEFERRED_BYTES // row_bytes, buffers.layout.max_context_rows)
        self.capacity = max(1, most)
        self.taps = torch.empty((self.capacity, taps.shape[1]), dtype=taps.dtype, device=taps.device)
        self._indexing: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per hold
        self.count = 0
        self.owners: dict[int, Sequence] = {}  # seq_id -> the sequence, for every sequence with rows held

    def has_room(self, num_rows: int) -> bool:
        return self.count + num_rows <= self.capacity

    def hold(self, taps: torch.Tensor, positions: torch.Tensor, seq_indices: torch.Tensor,
             slots: torch.Tensor, owners: list[Sequence]) -> None:
        """Hold context rows (taps [N, tap_width]; N positions, sequence indices and slots, tensors of
        this step's selection that nothing else writes): the taps' queued device copy, the rest kept."""
        num_rows = taps.shape[0]
        if not self.has_room(num_rows):
            raise ValueError(f"{num_rows} more rows do not fit: {self.count} of {self.capacity} are held")
        for name, values in (("positions", positions), ("seq_indices", seq_indices), ("slots", slots)):
            if values.shape != (num_rows,):
                raise ValueError(f"{name} must be [{num_rows}] like the taps, got {tuple(values.shape)}")
        self.taps[self.count:self.count + num_rows].copy_(taps)
        self._indexing.append((positions, seq_indices, slots))
        self.count += num_rows
        self.owners.update((seq.seq_id, seq) for seq in owners)

    def stage(self, buffers: StepBuffers) -> tuple[int, list[Sequence]]:
        """Put every held row back into the step buffers' context side and let go of them; returns
        their number and their owners."""
        if not self._indexing:  # nothing was ever held: nothing to stage
            return 0, self.clear()
        positions, seq_indices, slots = (torch.cat(parts) if len(parts) > 1 else parts[0]
                                         for parts in zip(*self._indexing))
        num_rows = buffers.stage_context(self.taps[:self.count], positions, seq_indices, slots)
        return num_rows, self.clear()

    def clear(self) -> list[Sequence]:
        """Forget every held row (a restarted pool: their slots were the old pool's); returns the owners."""
        owners = list(self.owners.values())
        self.count, self.owners, self._indexing = 0, {}, []
        return owners
