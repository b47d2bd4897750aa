"""One launch that picks a step's draft-context rows: their positions, sequence indices and slots.

`target_service.runner.context_rows` selects, among a step's tap rows, those whose token is committed
(every row of a prefill chunk with context, a decode's bonus and accepted drafts) and gives the rest
PAD_SLOT. In torch that is some fifteen small kernels plus their host dispatch; on a GPU where the
step is short (the demo pair: ~1.1 ms a step) their ~0.34 ms of host time a step was half of what
a hybrid step spent beyond a lookup-only engine's (0.09 ms with this kernel, on an H100). Here each
program takes one sequence's rows.

Inputs are the per-sequence counts the host knows (`per_seq` [PER_SEQ_FIELDS, S], its fields as
`kernels.reference.context_rows` names them) and the accepted drafts per decode on the device, so
nothing waits for the GPU. Several steps' rows may be picked in one launch (the hybrid holds the rows
of its lookup-only steps and stores them together): their tap and token rows are concatenated, and
each sequence says where its step's token rows begin and which accepted count is its own. The rows
may be written straight into the buffers that hand them over (`out`), so a step that stores at once
makes no copies of them.

The torch reference is `kernels.reference.context_rows`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference.context_rows import check_selection
from kernels.reference.store import PAD_SLOT

ROWS_PER_TILE = 64


@triton.jit
def _select_context_rows_kernel(tap_indices_ptr, positions_ptr, slot_mapping_ptr, per_seq_ptr, accepted_ptr,
                                positions_out, seq_indices_out, slots_out, num_seqs,
                                PAD: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    first = tl.load(per_seq_ptr + b)
    count = tl.load(per_seq_ptr + num_seqs + b)
    prefill_keep = tl.load(per_seq_ptr + 2 * num_seqs + b)
    decode_keep = tl.load(per_seq_ptr + 3 * num_seqs + b)
    seq_index = tl.load(per_seq_ptr + 4 * num_seqs + b)
    token_base = tl.load(per_seq_ptr + 5 * num_seqs + b)
    accepted_at = tl.load(per_seq_ptr + 6 * num_seqs + b)
    accepted = tl.load(accepted_ptr + accepted_at, mask=accepted_at >= 0, other=0).to(tl.int64)
    keep = prefill_keep + decode_keep * (1 + accepted)  # a decode: its bonus and its accepted drafts
    for start in range(0, count, BLOCK):
        j = start + tl.arange(0, BLOCK)
        live = j < count
        row = first + j
        token_row = token_base + tl.load(tap_indices_ptr + row, mask=live, other=0)
        tl.store(positions_out + row, tl.load(positions_ptr + token_row, mask=live), mask=live)
        tl.store(seq_indices_out + row, seq_index + j * 0, mask=live)
        slot = tl.load(slot_mapping_ptr + token_row, mask=live, other=0)
        tl.store(slots_out + row, tl.where(j < keep, slot, PAD), mask=live)


def select_context_rows(tap_indices: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        per_seq: torch.Tensor, accepted: torch.Tensor | None,
                        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, sequence indices, slots) of the tap rows, sequence after sequence.

    Parameters
    ----------
    tap_indices : Tensor [R], each tap row's token row, counted from its step's first token
    positions, slot_mapping : Tensor [T], the forward's per-token positions and pool slots (several
        steps' one after the other)
    per_seq : Tensor [PER_SEQ_FIELDS, S] int64, each sequence's first tap row, tap rows, rows kept as
        a prefill (0 for a decode or a sequence whose context has a gap), 1 where a decode keeps its
        rows, sequence index, first token row of its step, and index of its accepted count (-1: none)
    accepted : Tensor [D] or None, accepted drafts per decode
    out : three tensors of >= R rows to write into (the rows' first R), else new ones

    Returns
    -------
    positions [R] and slots [R] (PAD_SLOT where not kept), sequence indices [R]: `out`'s first R rows,
    else new tensors in the forward's dtypes (int64 sequence indices).
    """
    num_rows, num_seqs = tap_indices.shape[0], per_seq.shape[1]
    check_selection(tap_indices, per_seq, out)
    if out is None:
        out = (torch.empty(num_rows, dtype=positions.dtype, device=positions.device),
               torch.empty(num_rows, dtype=torch.int64, device=positions.device),
               torch.empty(num_rows, dtype=slot_mapping.dtype, device=slot_mapping.device))
    out_positions, out_seq_indices, out_slots = (values[:num_rows] for values in out)
    if num_rows and num_seqs:
        accepted_arg = accepted if accepted is not None else per_seq  # never read: every index is -1
        _select_context_rows_kernel[(num_seqs,)](
            tap_indices, positions, slot_mapping, per_seq, accepted_arg, out_positions, out_seq_indices,
            out_slots, num_seqs, PAD=PAD_SLOT, BLOCK=ROWS_PER_TILE, num_warps=1)
    return out_positions, out_seq_indices, out_slots

