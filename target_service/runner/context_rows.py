"""Which of a step's tap rows become draft context.

Every row the target ran has its taps; the drafter stores a row's context only where the token is
committed: all rows of a prefill chunk, a decode's bonus and its accepted drafts, and nothing of a
sequence whose context has a gap (`Sequence.has_context`). The rows' positions and pool slots are
the forward's own (`ForwardBatch`).

`context_rows` hands the drafter a step's rows in one of two forms:
- on a GPU, every tap row, the skipped ones with PAD_SLOT (stored nowhere): the accepted lengths are
  the device's, so the selection is one kernel over per-sequence counts (one copy to the device) and
  nothing waits for the GPU;
- elsewhere, only the kept rows: the accepted lengths are as good as on the host already, and a CPU
  drafter's store costs per row it is given. A decode verifying K drafts keeps 1 + accepted of its
  K + 1 rows (a quarter of them at K 15 and acceptance 4), so the PAD rows were most of the work.
The two store the same context."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.host_transfer import to_device
from kernels import PAD_SLOT
from kernels import context_rows as context_rows_kernel
from target_service.runner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class ContextRows:
    """A step's context rows as the drafter stages them: taps [N, tap_width], and N positions,
    sequence indices and pool slots (PAD_SLOT: stored nowhere)."""

    taps: torch.Tensor
    positions: torch.Tensor
    seq_indices: torch.Tensor
    slots: torch.Tensor

    @property
    def count(self) -> int:
        return self.taps.shape[0]


@dataclass(frozen=True)
class SeqTaps:
    """One scheduled sequence's tap rows: how many, whether it decodes, whether its context holds."""

    num_rows: int
    is_decode: bool
    has_context: bool
    seq_index: int


def context_rows(batch: ForwardBatch, seqs: list[SeqTaps], accepted: torch.Tensor | None,
                 taps: torch.Tensor) -> ContextRows:
    """The step's context rows (taps [R, tap_width]: the forward's, one per tap row): on a GPU all R,
    selected on the device; elsewhere the kept ones only (the module's docstring says why)."""
    if batch.device.type == "cuda":
        return ContextRows(taps, *select_context_rows(batch, seqs, accepted))  # which checks the rows
    _check_rows(batch, seqs)
    rows, seq_indices = kept_tap_rows(seqs, accepted)
    kept = torch.tensor(rows, dtype=torch.int64, device=batch.device)
    token_rows = batch.tap_indices[kept]
    return ContextRows(taps[kept], batch.positions[token_rows],
                       torch.tensor(seq_indices, dtype=torch.int64, device=batch.device),
                       batch.slot_mapping[token_rows])


def kept_tap_rows(seqs: list[SeqTaps], accepted: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """(the tap rows whose context is kept, in order; each one's sequence index), from the accepted
    drafts per decode, read on the host."""
    per_decode = [] if accepted is None else accepted.tolist()
    rows, seq_indices, first = [], [], 0
    for index, seq in enumerate(seqs):
        if seq.has_context:
            if seq.is_decode:  # its bonus and its accepted drafts (decodes come first, as accepted's rows)
                keep = min(seq.num_rows, 1 + (per_decode[index] if index < len(per_decode) else 0))
            else:
                keep = seq.num_rows
            rows.extend(range(first, first + keep))
            seq_indices.extend([seq.seq_index] * keep)
        first += seq.num_rows
    return rows, seq_indices


def _check_rows(batch: ForwardBatch, seqs: list[SeqTaps]) -> None:
    num_rows = batch.tap_indices.shape[0]
    if sum(seq.num_rows for seq in seqs) != num_rows:
        raise RuntimeError(f"the step's sequences own {sum(seq.num_rows for seq in seqs)} tap rows; the "
                           f"forward returned {num_rows}")


def select_context_rows(batch: ForwardBatch, seqs: list[SeqTaps], accepted: torch.Tensor | None):
    """The context side's per-row positions, sequence indices and pool slots (PAD_SLOT: skipped) for
    all the batch's tap rows, sequence after sequence in `seqs` order (decodes first): the GPU's form.

    accepted: accepted drafts per decode [D] on the device (None: a step without drafts). On a GPU,
    one kernel (`kernels.context_rows`); elsewhere the torch ops below, its reference."""
    _check_rows(batch, seqs)
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
    """`select_context_rows` in torch ops: the kernel's reference (an engine off a GPU takes
    `context_rows`' kept rows instead)."""
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
