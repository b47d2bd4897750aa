"""DeferredContext: context rows of lookup-only and prefill-only steps, kept on the device to be stored
together later.

A hybrid step that skips the DFlash drafter still has to keep the drafter's context whole (DFlash may
take over at any step), but nothing reads that context until the drafter next runs. Storing it then,
for several steps at once, reads the drafter's context weights once instead of once per step: on a
CPU the store of a lookup-only step cost about 12% of it (the demo pair, one sequence), and the
demo drafter stores 16 rows in 1.4 ms but 100 in 3.0 ms (2 threads), not 9.

The taps are copied into a buffer of this object's own straight from the step's rows, without a
trip through the step buffers (whose writes would first wait for the drafter): they are the
forward's output, which the next step overwrites. What says which rows are kept is made for this
step alone (on a GPU: the forward's token rows, positions and slots, and the accepted drafts, not
picked yet; elsewhere the kept rows' positions, sequence indices and slots), so it is kept as it
is. When the rows are staged into the step buffers to be stored, every held step's rows are picked
at once, in one launch straight into the buffers (`context_rows.stage_context_rows`): a held step
costs the host one copy of its taps, where picking its rows as it ran cost a table's copy to the
device, three allocations and a kernel launch as well. Only
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
from target_service.runner.context_rows import ContextRows, KeptRows, RowSelection, stage_context_rows

MAX_DEFERRED_ROWS = DEFERRED_STORE_ROWS  # 16 steps of one sequence at K 15; its store replays a graph
MAX_DEFERRED_BYTES = 64 << 20  # of taps: 256 rows at Qwen3-8B's five taps of 4096 take 10 MB in bf16


class DeferredContext:
    def __init__(self, buffers: StepBuffers, capacity: int = MAX_DEFERRED_ROWS):
        taps = buffers.taps
        row_bytes = max(1, taps.shape[1] * taps.element_size())
        most = min(capacity, MAX_DEFERRED_BYTES // row_bytes, buffers.layout.max_context_rows)
        self.capacity = max(1, most)
        self.taps = torch.empty((self.capacity, taps.shape[1]), dtype=taps.dtype, device=taps.device)
        self._parts: list[KeptRows | RowSelection] = []  # per hold: its rows' indices
        self.count = 0
        self.owners: dict[int, Sequence] = {}  # seq_id -> the sequence, for every sequence with rows held

    def has_room(self, num_rows: int) -> bool:
        return self.count + num_rows <= self.capacity

    def hold(self, context: ContextRows, owners: list[Sequence]) -> None:
        """Hold a step's context rows (taps [N, tap_width], the forward's, and the N rows' indices,
        made for this step alone): the taps' queued device copy, the rest kept as it is."""
        num_rows = context.count
        if not self.has_room(num_rows):
            raise ValueError(f"{num_rows} more rows do not fit: {self.count} of {self.capacity} are held")
        if context.rows.num_rows != num_rows:
            raise ValueError(f"the rows' indices cover {context.rows.num_rows} rows, taps has {num_rows}")
        self.taps[self.count:self.count + num_rows].copy_(context.taps)
        self._parts.append(context.rows)
        self.count += num_rows
        self.owners.update((seq.seq_id, seq) for seq in owners)

    def stage(self, buffers: StepBuffers) -> tuple[int, list[Sequence]]:
        """Put every held row back into the step buffers' context side and let go of them; returns
        their number and their owners."""
        if not self._parts:  # nothing was ever held: nothing to stage
            return 0, self.clear()
        num_rows = stage_context_rows(buffers, self.taps[:self.count], self._parts)
        return num_rows, self.clear()

    def clear(self) -> list[Sequence]:
        """Forget every held row (a restarted pool: their slots were the old pool's); returns the owners."""
        owners = list(self.owners.values())
        self.count, self.owners, self._parts = 0, {}, []
        return owners
