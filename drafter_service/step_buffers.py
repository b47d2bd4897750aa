"""StepBuffers: the per-step data the target and the drafter exchange, in one buffer both map.

Per step the target writes, and the drafter reads, two sides (nothing large crosses a call):

context side, up to `max_context_rows` rows (every row the target ran this step):
    taps              [R, tap_width]  the target's tapped hidden states (n_taps * hidden_size)
    context_positions [R] int64       each row's absolute position
    context_seq_indices [R] int64     each row's sequence index (the dense baseline addresses by it)
    context_slots     [R] int64       each row's pool slot; PAD_SLOT skips the row (rejected drafts)
propose side, up to `max_num_seqs` rows (one per drafting sequence):
    bonus_tokens      [S] int64       the newest committed token (position 0 of the noise block)
    start_positions   [S] int64       its position; the stored context is positions 0..start-1
    seq_indices       [S] int64
    block_table       [S, M] int32    the sequence's block ids, zero-padded to M columns
    draft_tokens      [S, K] int64    written back by the drafter

The buffer is a `foundation.shared_buffer` buffer: private in the one-process engine, a /dev/shm
file or a CUDA IPC allocation when the drafter runs in another process. The calls between the two
(`drafter_service.control.DraftControl`) carry only row counts. Fixed shapes and fixed addresses
are also what a CUDA graph needs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, PositiveInt

from foundation.host_transfer import to_device
from foundation.shared_buffer import BufferHandle, OwnedBuffer, map_buffer

ALIGN = 256  # bytes; every field starts on a boundary CUDA kernels like
_INT = torch.int64


class StepBufferLayout(BaseModel):
    """The sizes of one pair's step buffers; both sides must agree on it exactly."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_num_seqs: PositiveInt
    max_blocks_per_seq: PositiveInt
    max_num_draft: PositiveInt  # the drafter's block_size - 1
    max_context_rows: PositiveInt  # the target's max_num_batched_tokens
    tap_width: PositiveInt  # len(target_layer_ids) * hidden_size
    tap_dtype: Literal["bfloat16", "float16", "float32"]

    def fields(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every field, in buffer order."""
        rows, seqs = self.max_context_rows, self.max_num_seqs
        return {
            "taps": ((rows, self.tap_width), getattr(torch, self.tap_dtype)),
            "context_positions": ((rows,), _INT),
            "context_seq_indices": ((rows,), _INT),
            "context_slots": ((rows,), _INT),
            "bonus_tokens": ((seqs,), _INT),
            "start_positions": ((seqs,), _INT),
            "seq_indices": ((seqs,), _INT),
            "block_table": ((seqs, self.max_blocks_per_seq), torch.int32),
            "draft_tokens": ((seqs, self.max_num_draft), _INT),
        }

    def offsets(self) -> tuple[dict[str, int], int]:
        """Byte offset of every field, and the buffer's total bytes."""
        offsets, offset = {}, 0
        for name, (shape, dtype) in self.fields().items():
            offsets[name] = offset
            offset = -(-(offset + math.prod(shape) * dtype.itemsize) // ALIGN) * ALIGN
        return offsets, offset


@dataclass(frozen=True)
class StepBuffersHandle:
    """What the other side needs to map the step buffers (picklable unless in-process)."""

    layout: StepBufferLayout
    buffer: BufferHandle


class StepBuffers:
    """Typed views of one pair's step buffers, as their owner (`create`) or attached (`attach`)."""

    def __init__(self, layout: StepBufferLayout, buffer: torch.Tensor, owned: OwnedBuffer | None = None):
        self.layout = layout
        self._owned = owned
        self._buffer = buffer
        offsets, _ = layout.offsets()
        for name, (shape, dtype) in layout.fields().items():
            start = offsets[name]
            view = buffer[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            setattr(self, name, view)

    @classmethod
    def create(cls, layout: StepBufferLayout, device: torch.device | str, *, share: bool) -> StepBuffers:
        """Zeroed buffers on `device`; `share=False` keeps them private to this process."""
        _, nbytes = layout.offsets()
        name = f"dflash-step-{os.getpid()}-{os.urandom(6).hex()}"
        owned = OwnedBuffer.allocate(nbytes, device, share=share, file_name=name)
        return cls(layout, owned.tensor, owned)

    @classmethod
    def attach(cls, handle: StepBuffersHandle, expected: StepBufferLayout) -> StepBuffers:
        """Map the buffers behind `handle`; refuse them unless their layout is exactly `expected`."""
        if not isinstance(handle, StepBuffersHandle):
            raise TypeError(f"handle must be a StepBuffersHandle, got {type(handle).__name__}")
        if handle.layout != expected:
            have, want = handle.layout.model_dump(), expected.model_dump()
            diffs = [f"{key}: buffers have {have[key]!r}, expected {want[key]!r}"
                     for key in want if have[key] != want[key]]
            raise ValueError("step buffer layout mismatch: " + "; ".join(diffs))
        return cls(expected, map_buffer(handle.buffer))

    def export(self) -> StepBuffersHandle:
        if self._owned is None:
            raise RuntimeError("only the step buffers' owner exports them; pass on the handle you "
                               "attached with")
        return StepBuffersHandle(self.layout, self._owned.export())

    def close(self) -> None:
        """Drop the mapping; the owner also removes its /dev/shm file. Idempotent."""
        if self._owned is not None and self._owned.file is not None:
            self._owned.file.remove()
        self._buffer = None

    # ---- the target's side: stage one step ------------------------------------------------------

    def stage_context(self, taps: torch.Tensor, positions, seq_indices, slots) -> int:
        """Write the context side's first N rows (taps [N, tap_width]); returns N.

        positions, seq_indices, slots: N ints each, as lists or as integer tensors (on the buffers'
        device they are copied there without a trip through the host)."""
        count = taps.shape[0]
        for name, values in (("positions", positions), ("seq_indices", seq_indices), ("slots", slots)):
            if len(values) != count:
                raise ValueError(f"{name} has {len(values)} rows, taps has {count}")
        self.stage_context_taps(taps)
        self._write(self.context_positions, positions)
        self._write(self.context_seq_indices, seq_indices)
        self._write(self.context_slots, slots)
        return count

    def stage_context_taps(self, taps: torch.Tensor) -> int:
        """Write the context side's first N taps (taps [N, tap_width]) alone; returns N. The caller
        writes the rows' positions, sequence indices and slots itself (a kernel that picks them)."""
        count = taps.shape[0]
        self.check_context_rows(count)
        if taps.dim() != 2 or taps.shape[1] != self.layout.tap_width:
            raise ValueError(f"taps must be [N, {self.layout.tap_width}], got {tuple(taps.shape)}")
        self.taps[:count].copy_(taps)
        return count

    def stage_propose(self, bonus_tokens: list[int], start_positions: list[int], seq_indices: list[int],
                      block_tables: list[list[int]]) -> int:
        """Write the propose side's first B rows; returns the block-table columns used.

        The four fields travel as one table [B, 3 + columns] in one host-to-device copy, then are
        copied into place on the device: a host-to-device transfer costs the host a pinned staging
        buffer as well as a copy's launch, so one transfer and four device-side copies cost it less
        than four transfers (the step's saving is not measured on its own)."""
        count = len(bonus_tokens)
        self.check_propose(count, 1, 1)
        columns = max(len(table) for table in block_tables)
        self.check_propose(count, 1, columns)
        lengths = {len(start_positions), len(seq_indices), len(block_tables)}
        if lengths != {count}:
            raise ValueError(f"one bonus token, start position, sequence index and block table per row: "
                             f"got {count}, {len(start_positions)}, {len(seq_indices)}, {len(block_tables)}")
        rows = [[bonus, start, index, *table, *[0] * (columns - len(table))]
                for bonus, start, index, table in zip(bonus_tokens, start_positions, seq_indices,
                                                      block_tables)]
        staged = to_device(rows, torch.int64, self.block_table.device)
        self.bonus_tokens[:count].copy_(staged[:, 0])
        self.start_positions[:count].copy_(staged[:, 1])
        self.seq_indices[:count].copy_(staged[:, 2])
        self.block_table[:count, :columns].copy_(staged[:, 3:])
        return columns

    def stage_propose_tensors(self, bonus_tokens: torch.Tensor, start_positions: torch.Tensor,
                              seq_indices: torch.Tensor, block_table: torch.Tensor) -> int:
        """`stage_propose` from tensors on the buffers' device ([B] int64 each, block_table [B, M]
        int32): a step launched before the host knows its inputs stages them without a host trip."""
        count, columns = block_table.shape
        self.check_propose(count, 1, columns)
        for name, values in (("start_positions", start_positions), ("seq_indices", seq_indices),
                             ("bonus_tokens", bonus_tokens)):
            if values.shape != (count,):
                raise ValueError(f"{name} must be [{count}] (block_table's rows), got {tuple(values.shape)}")
        self._write(self.bonus_tokens, bonus_tokens)
        self._write(self.start_positions, start_positions)
        self._write(self.seq_indices, seq_indices)
        self.block_table[:count, :columns].copy_(block_table)
        return columns

    def _write(self, field: torch.Tensor, values) -> None:
        if isinstance(values, torch.Tensor):
            field[:values.shape[0]].copy_(values)
        else:
            field[:len(values)].copy_(to_device(values, field.dtype, field.device))

    # ---- checks both sides make -------------------------------------------------------------------

    def check_context_rows(self, num_rows: int) -> None:
        if not 0 <= num_rows <= self.layout.max_context_rows:
            raise ValueError(f"num_rows must be in 0..{self.layout.max_context_rows} (the step buffers' "
                             f"max_context_rows), got {num_rows}")

    def check_propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        layout = self.layout
        for name, value, limit in (("num_seqs", num_seqs, layout.max_num_seqs),
                                   ("num_draft", num_draft, layout.max_num_draft),
                                   ("num_block_cols", num_block_cols, layout.max_blocks_per_seq)):
            if not 1 <= value <= limit:
                raise ValueError(f"{name} must be in 1..{limit} (the step buffers' limit), got {value}")
