"""Which of a step's tap rows become draft context, and how they are staged for the drafter.

Every row the target ran has its taps; the drafter stores a row's context only where the token is
committed: all rows of a prefill chunk, a decode's bonus and its accepted drafts, and nothing of a
sequence whose context has a gap (`Sequence.has_context`). The rows' positions and pool slots are
the forward's own (`ForwardBatch`).

`context_rows` hands the drafter a step's rows in one of two forms:
- on a GPU, every tap row, the skipped ones with PAD_SLOT (stored nowhere): the accepted lengths are
  the device's, so the selection is one kernel over per-sequence counts (one copy to the device) and
  nothing waits for the GPU. The rows come unpicked (`RowSelection`): they are picked when staged
  (`stage_context_rows`), straight into the step buffers, and the rows of several steps that a
  proposer held (the hybrid's lookup-only steps) are picked together, in one launch;
- elsewhere, only the kept rows (`KeptRows`): the accepted lengths are as good as on the host
  already, and a CPU drafter's store costs per row it is given. A decode verifying K drafts keeps
  1 + accepted of its K + 1 rows (a quarter of them at K 15 and acceptance 4), so the PAD rows were
  most of the work.
The two store the same context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from drafter_service.step_buffers import StepBuffers
from foundation.host_transfer import to_device
from kernels import context_rows as context_rows_kernel
from kernels.reference import context_rows as context_rows_reference
from target_service.runner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class SeqTaps:
    """One scheduled sequence's tap rows: how many, whether it decodes, whether its context holds."""

    num_rows: int
    is_decode: bool
    has_context: bool
    seq_index: int


class KeptRows(NamedTuple):
    """Rows as the drafter stages them: N positions, sequence indices and pool slots (PAD_SLOT: stored
    nowhere)."""

    positions: torch.Tensor
    seq_indices: torch.Tensor
    slots: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]


@dataclass(frozen=True)
class RowSelection:
    """A step's tap rows not picked yet: what picking them reads (the forward's tensors, made for this
    step alone, and the accepted drafts per decode on the device) and its sequences in tap-row order
    (decodes first)."""

    tap_indices: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    accepted: torch.Tensor | None
    seqs: tuple[SeqTaps, ...]

    @classmethod
    def of(cls, batch: ForwardBatch, seqs: Sequence[SeqTaps], accepted: torch.Tensor | None) -> RowSelection:
        return cls(batch.tap_indices, batch.positions, batch.slot_mapping, accepted, tuple(seqs))

    @property
    def num_rows(self) -> int:
        return self.tap_indices.shape[0]


@dataclass(frozen=True)
class ContextRows:
    """A step's context rows: taps [N, tap_width] and the N rows' indices, picked or not."""

    taps: torch.Tensor
    rows: KeptRows | RowSelection

    @property
    def count(self) -> int:
        return self.taps.shape[0]


def context_rows(batch: ForwardBatch, seqs: list[SeqTaps], accepted: torch.Tensor | None,
                 taps: torch.Tensor) -> ContextRows:
    """The step's context rows (taps [R, tap_width]: the forward's, one per tap row): on a GPU all R,
    to be picked on the device when staged; elsewhere the kept ones only (the module's docstring
    says why)."""
    _check_rows(batch, seqs)
    if batch.device.type == "cuda":
        return ContextRows(taps, RowSelection.of(batch, seqs, accepted))
    rows, seq_indices = kept_tap_rows(seqs, accepted)
    kept = torch.tensor(rows, dtype=torch.int64, device=batch.device)
    token_rows = batch.tap_indices[kept]
    return ContextRows(taps[kept], KeptRows(batch.positions[token_rows],
                                            torch.tensor(seq_indices, dtype=torch.int64, device=batch.device),
                                            batch.slot_mapping[token_rows]))


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


def select_context_rows(batch: ForwardBatch, seqs: list[SeqTaps], accepted: torch.Tensor | None) -> KeptRows:
    """Every tap row of one step with its position, sequence index and slot (PAD_SLOT: skipped), the GPU's
    form; accepted: accepted drafts per decode [D] on the device (None: a step without drafts)."""
    _check_rows(batch, seqs)
    return pick_rows([RowSelection.of(batch, seqs, accepted)])


def pick_rows(selections: Sequence[RowSelection], out=None) -> KeptRows:
    """The rows of one or more steps' selections, in order, picked in one launch on a GPU (the torch
    reference elsewhere); into `out`'s first rows (three tensors) when given."""
    device = selections[0].tap_indices.device
    table = per_seq_table(selections, device)
    if len(selections) == 1:
        only = selections[0]
        inputs = (only.tap_indices, only.positions, only.slot_mapping, only.accepted)
    else:
        accepted = [selection.accepted for selection in selections if selection.accepted is not None]
        inputs = (torch.cat([selection.tap_indices for selection in selections]),
                  torch.cat([selection.positions for selection in selections]),
                  torch.cat([selection.slot_mapping for selection in selections]),
                  torch.cat(accepted) if accepted else None)
    select = (context_rows_kernel if device.type == "cuda" else context_rows_reference).select_context_rows
    tap_indices, positions, slot_mapping, accepted = inputs
    return KeptRows(*select(tap_indices, positions, slot_mapping, table, accepted, out))


def per_seq_table(selections: Sequence[RowSelection], device) -> torch.Tensor:
    """[PER_SEQ_FIELDS, S] int64 on the device, one copy, over every sequence of the selections in order
    (the kernel's `per_seq`): first tap row, rows, rows a prefill keeps, whether a decode keeps its
    rows, sequence index, its step's first token row, and its accepted count's index (-1: none)."""
    fields = [[] for _ in range(context_rows_reference.PER_SEQ_FIELDS)]
    firsts, counts, prefill_keeps, decode_keeps, seq_indices, token_bases, accepted_at = fields
    first = token_base = accepted_base = 0
    for selection in selections:
        num_accepted = 0 if selection.accepted is None else selection.accepted.shape[0]
        for index, seq in enumerate(selection.seqs):
            firsts.append(first)
            counts.append(seq.num_rows)
            prefill_keeps.append(seq.num_rows if seq.has_context and not seq.is_decode else 0)
            decode_keeps.append(int(seq.is_decode and seq.has_context))
            seq_indices.append(seq.seq_index)
            token_bases.append(token_base)
            accepted_at.append(accepted_base + index if index < num_accepted else -1)
            first += seq.num_rows
        token_base += selection.positions.shape[0]
        accepted_base += num_accepted
    return to_device(fields, torch.int64, device)


def stage_context_rows(buffers: StepBuffers, taps: torch.Tensor,
                       parts: Sequence[KeptRows | RowSelection]) -> int:
    """Write rows into the step buffers' context side (taps [N, tap_width], then the N rows of `parts`,
    at least one part, in order); returns N. Unpicked rows are picked in one launch, straight into the
    buffers."""
    num_rows = sum(part.num_rows for part in parts)
    if num_rows != taps.shape[0]:
        raise ValueError(f"the parts hold {num_rows} rows, taps has {taps.shape[0]}")
    if parts and all(isinstance(part, RowSelection) for part in parts):
        buffers.stage_context_taps(taps)
        pick_rows(parts, out=(buffers.context_positions, buffers.context_seq_indices, buffers.context_slots))
        return num_rows
    kept = [part if isinstance(part, KeptRows) else pick_rows([part]) for part in parts]
    joined = (torch.cat(values) if len(values) > 1 else values[0] for values in zip(*kept))
    return buffers.stage_context(taps, *joined)
