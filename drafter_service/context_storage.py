"""Where the drafter's context K/V lives: paged in the pool (the design) or dense (the baseline).

Both present the same thing to the model: per-layer page views, a slot for each stored token and a
block-table row for each drafting sequence, so one kernel (`kernels.paged_context_attention`) reads
either. Paged context shares the target's block ids, so its slots ARE the target's slots. Dense
context is one buffer reserved up front, `[L, 2, max_num_seqs, padded_len, H, D]`: each sequence index
owns a contiguous run of pseudo-pages, and its block-table row is simply that run.
"""

from __future__ import annotations

import torch

from kernels import PAD_SLOT
from kvpool_service.geometry import LayerGroup


class PagedContext:
    """Draft context in the pool's draft group: same blocks, same slots as the target."""

    kind = "paged"

    def __init__(self, layers):
        self.caches = list(layers)

    def slot_mapping(self, seq_indices: torch.Tensor, positions: torch.Tensor,
                     target_slots: torch.Tensor) -> torch.Tensor:
        return target_slots

    def block_table(self, seq_indices: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        return block_table


class DenseContext:
    """Draft context in a dense per-sequence reservation made at start-up (the baseline)."""

    kind = "dense"

    def __init__(self, group: LayerGroup, *, max_num_seqs: int, max_model_len: int, tokens_per_block: int,
                 device: torch.device | str):
        self.tokens_per_block = tokens_per_block
        self.pages_per_seq = -(-max_model_len // tokens_per_block)
        padded = self.pages_per_seq * tokens_per_block
        dtype = getattr(torch, group.dtype)
        self.buffer = torch.zeros(group.num_layers, 2, max_num_seqs, padded, group.num_kv_heads,
                                  group.head_dim, dtype=dtype, device=device)
        shape = (max_num_seqs * self.pages_per_seq, tokens_per_block, group.num_kv_heads, group.head_dim)
        scales = torch.ones(group.num_layers, 2, dtype=torch.float32, device=device) if group.is_fp8 else None
        self.caches = [
            (self.buffer[layer, 0].view(shape), self.buffer[layer, 1].view(shape),
             None if scales is None else scales[layer, 0], None if scales is None else scales[layer, 1])
            for layer in range(group.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def slot_mapping(self, seq_indices: torch.Tensor, positions: torch.Tensor,
                     target_slots: torch.Tensor) -> torch.Tensor:
        slots = seq_indices * (self.pages_per_seq * self.tokens_per_block) + positions
        return torch.where(target_slots == PAD_SLOT, torch.full_like(slots, PAD_SLOT), slots)

    def block_table(self, seq_indices: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """Each sequence index's own run of pseudo-pages; the pool's block table is not used."""
        pages = torch.arange(self.pages_per_seq, device=seq_indices.device, dtype=torch.int32)
        return (seq_indices[:, None].to(torch.int32) * self.pages_per_seq + pages).contiguous()
