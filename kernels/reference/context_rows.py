"""Reference of `kernels.context_rows`: the kept draft-context rows of one or several steps, in torch ops.

`per_seq` [PER_SEQ_FIELDS, S] int64 describes each sequence (columns) by its first tap row, its tap
rows, the rows it keeps as a prefill, whether it keeps a decode's bonus and accepted drafts, its
sequence index, the first token row of its step (steps' token rows lie one after the other) and
which accepted count is its own (-1: none).
"""

from __future__ import annotations

import torch

from kernels.reference.store import PAD_SLOT

PER_SEQ_FIELDS = 7


def check_selection(tap_indices: torch.Tensor, per_seq: torch.Tensor, out) -> None:
    """The shapes a selection needs, as a clear error (a kernel would read out of bounds instead)."""
    if per_seq.dim() != 2 or per_seq.shape[0] != PER_SEQ_FIELDS or per_seq.dtype != torch.int64:
        raise ValueError(f"per_seq must be int64 [{PER_SEQ_FIELDS}, S], got {per_seq.dtype} "
                         f"{tuple(per_seq.shape)}")
    if out is not None and any(values.shape[0] < tap_indices.shape[0] for values in out):
        raise ValueError(f"out must hold {tap_indices.shape[0]} rows, got "
                         f"{[values.shape[0] for values in out]}")


def select_context_rows(tap_indices: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        per_seq: torch.Tensor, accepted: torch.Tensor | None, out=None):
    """`kernels.context_rows.select_context_rows` in torch ops (same arguments and results)."""
    check_selection(tap_indices, per_seq, out)
    num_rows, device = tap_indices.shape[0], tap_indices.device
    first, counts, prefill_keeps, decode_keeps, seq_indices, token_bases, accepted_at = per_seq
    verified = torch.ones_like(decode_keeps)  # a decode keeps its bonus and its accepted drafts
    has_accepted = accepted_at >= 0
    if accepted is not None and bool(has_accepted.any()):
        verified[has_accepted] += accepted.to(torch.int64)[accepted_at[has_accepted]]
    keeps = prefill_keeps + decode_keeps * verified
    owner = torch.repeat_interleave(torch.arange(per_seq.shape[1], device=device), counts,
                                    output_size=num_rows)
    offset = torch.arange(num_rows, device=device) - first[owner]
    token_rows = tap_indices + token_bases[owner]
    results = (positions[token_rows], seq_indices[owner],
               torch.where(offset < keeps[owner], slot_mapping[token_rows], PAD_SLOT))
    if out is None:
        return results
    for values, result in zip(out, results):
        values[:num_rows].copy_(result)
    return tuple(values[:num_rows] for values in out)
