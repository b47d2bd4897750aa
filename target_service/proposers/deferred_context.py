"""DeferredContext: context rows of lookup-only and prefill-only steps, kept on the device to be stored
together later.

A hybrid step that skips the DFlash drafter still has to keep the drafter's context whole (DFlash may
take over at any step), but nothing reads that context until the drafter next runs. Storing it then,
for several steps at once, reads the drafter's context weights once instead of once per step: on a
CPU the store of a lookup-only step cost about 12% of it (the demo pair, one sequence), and the
demo drafter stores 16 rows in 1.4 ms but 100 in 3.0 ms (2 threads), not 9.

The rows (taps, positions, sequence indices and pool slots, exactly what the runner selected) are
copied into buffers of this object's own straight from the step's selection, without a trip
through the step buffers (whose writes would first wait for the drafter), and staged into the step
buffers when they are stored. Only the owner decides when (`HybridProposer`): before
the drafter reads the context, before a sequence's pages are released (after that its slots may be
another sequence's), and when the next step's rows would not fit. `owners` are the sequences whose
rows are held, so a store that the drafter misses can mark their context as having a gap.
"""

from __future__ import annotations

import torch

from drafter_service.step_buffers import StepBuffers
from target_service.engine.sequence import Sequence

MAX_DEFERRED_ROWS = 256  # 16 steps of one sequence at K 15; 10 MB of taps at the 8B geometry


class DeferredContext:
    def __init__(self, buffers: StepBuffers, capacity: int = MAX_DEFERRED_ROWS):
        self.capacity = min(capacity, buffers.layout.max_context_rows)
        taps = buffers.taps
        self.taps = torch.empty((self.capacity, taps.shape[1]), dtype=taps.dtype, device=taps.device)
        self.positions, self.seq_indices, self.slots = (
            torch.empty(self.capacity, dtype=torch.int64, device=taps.device) for _ in range(3))
        self.count = 0
        self.owners: dict[int, Sequence] = {}  # seq_id -> the sequence, for every sequence with rows held

    def has_room(self, num_rows: int) -> bool:
        return self.count + num_rows <= self.capacity

    def hold(self, taps: torch.Tensor, positions: torch.Tensor, seq_indices: torch.Tensor,
             slots: torch.Tensor, owners: list[Sequence]) -> None:
        """Hold context rows (taps [N, tap_width]; N positions, sequence indices and slots): queued
        device copies, straight from the step's own selection."""
        num_rows = taps.shape[0]
        if not self.has_room(num_rows):
            raise ValueError(f"{num_rows} more rows do not fit: {self.count} of {self.capacity} are held")
        rows = slice(self.count, self.count + num_rows)
        self.taps[rows].copy_(taps)
        self.positions[rows].copy_(positions)
        self.seq_indices[rows].copy_(seq_indices)
        self.slots[rows].copy_(slots)
        self.count += num_rows
        self.owners.update((seq.seq_id, seq) for seq in owners)

    def stage(self, buffers: StepBuffers) -> tuple[int, list[Sequence]]:
        """Put every held row back into the step buffers' context side and let go of them; returns
        their number and their owners."""
        held = slice(0, self.count)
        num_rows = buffers.stage_context(self.taps[held], self.positions[held], self.seq_indices[held],
                                         self.slots[held])
        return num_rows, self.clear()

    def clear(self) -> list[Sequence]:
        """Forget every held row (a restarted pool: their slots were the old pool's); returns the owners."""
        owners = list(self.owners.values())
        self.count, self.owners = 0, {}
        return owners
