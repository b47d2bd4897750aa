"""Which of a step's tap rows become draft context, selected on the device.

Every row the target ran has its taps; the drafter stores a row's context only where the token is
committed: all rows of a prefill chunk, a decode's bonus and its accepted drafts, and nothing of a
sequence whose context has a gap (`Sequence.has_context`). The rows' positions and pool slots are
the forward's own (`ForwardBatch`), and the accepted lengths are the device's, so the selection is a
few kernels over per-sequence counts (one copy to the device) and nothing waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.host_transfer import to_device
from kernels import PAD_SLOT
from kernels import context_rows as context_rows_kernel
from target_service.runner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class SeqTaps:
    """One scheduled sequence's tap rows: how many, whether it decodes, whether its context holds."""

    num_rows: int
    is_decode: bool
    has_context: bool
    seq_index: int


def select_context_rows(batch: ForwardBatch, seqs: list[SeqTaps], accepted: torch.Tensor | None):
    """The context side's per-row positions, sequence indices and pool slots (PAD_SLOT: skipped) for
    the batch's tap rows, sequence after sequence in `seqs` order (decodes first).

    accepted: accepted drafts per decode [D] on the device (None: a step without drafts). On a GPU,
    one kernel (`kernels.context_rows`); elsewhere the torch ops below, its reference."""
    num_rows = batch.tap_indices.shape[0]
    if sum(seq.num_rows for seq in seqs) != num_rows:
        raise RuntimeError(f"the step's sequences own {sum(seq.num_rows for seq in seqs)} tap rows; the "
                           f"forward returned {num_rows}")
    if batch.device.type == "cuda":
        return context_rows_kernel.select_context_rows(batch.tap_indices, batch.positions, batch.slot_mapping,
                                                       per_seq_table(seqs, batch.device), accepted)
    return select_context_rows_torch(batch, seqs, accepted)


def per_seq_table(seqs: list[SeqTaps], device) -> torch.Tensor:
    """[5, S] int64 on the device, one copy: first tap row, rows, rows a prefill keeps, whether a decode
    keeps its rows, sequence index (the kernel's `per_seq`)."""
    firsts, first = [], 0
    for seq in seqs:
        firsts.append(first)
        first += seq.num_rows
    return to_device([firsts, [seq.num_rows for seq in seqs],
                      [seq.num_rows if seq.has_context and not seq.is_decode else 0 for seq in seqs],
                      [int(seq.is_decode and seq.has_context) for seq in seqs],
                      [seq.seq_index for seq in seqs]], torch.int64, device)


def select_context_rows_torch(batch: ForwardBatch, seqs: list[SeqTaps], accepted: torch.Tensor | None):
    """`select_context_rows` in torch ops: the CPU path, and the kernel's reference."""
    num_rows, device = batch.tap_indices.shape[0], batch.device
    _, counts, prefill_keeps, decode_keeps, seq_indices = per_seq_table(seqs, device)
    verified = torch.ones_like(decode_keeps)  # a decode keeps its bonus and its accepted drafts
    if accepted is not None:
        verified[:accepted.shape[0]] += accepted
    keeps = prefill_keeps + decode_keeps * verified
    owner = torch.repeat_interleave(torch.arange(len(seqs), device=device), counts, output_size=num_rows)
    offset = torch.arange(num_rows, device=device) - (torch.cumsum(counts, 0) - counts)[owner]
    rows = batch.tap_indices
    slots = torch.where(offset < keeps[owner], batch.slot_mapping[rows], PAD_SLOT)
    return batch.positions[rows], seq_indices[owner], slots
