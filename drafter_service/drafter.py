"""DraftWorker: the drafter service's domain object (the Ray actor will only delegate to it).

It owns the draft model and the context storage, and offers the two calls a step needs:
`store_context` after the target ran (taps of committed tokens -> context K/V) and `propose` before
the target verifies (noise block -> K draft tokens). Metadata comes in as plain tensors.
"""

from __future__ import annotations

import torch

from drafter_service.draft_batch import DraftBatch
from drafter_service.model import DFlashDrafter


class DraftWorker:
    def __init__(self, model: DFlashDrafter, context, *, embed: torch.Tensor, lm_head: torch.Tensor):
        """context: a PagedContext or DenseContext; embed / lm_head: the target's [V, H] tables."""
        self.model = model
        self.context = context
        self.embed = embed
        self.lm_head = lm_head

    @property
    def block_size(self) -> int:
        return self.model.block_size

    def store_context(self, taps: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
                      target_slots: torch.Tensor) -> None:
        """Project taps [N, n_taps*H] of committed tokens and write them at their positions.

        seq_slots [N]: each row's sequence slot; target_slots [N]: its target slot (-1: skip the row).
        """
        if taps.shape[0] == 0:
            return
        slots = self.context.slot_mapping(seq_slots, positions, target_slots)
        self.model.project_context(taps, positions, slots, self.context.caches)

    def propose(self, bonus_tokens: torch.Tensor, start_positions: torch.Tensor, seq_slots: torch.Tensor,
                target_block_table: torch.Tensor, num_speculative_tokens: int) -> torch.Tensor:
        """Draft tokens [B, K]; each sequence's context is positions 0..start-1."""
        batch = DraftBatch(
            bonus_tokens=bonus_tokens, start_positions=start_positions,
            block_table=self.context.block_table(seq_slots, target_block_table),
            ctx_lens=start_positions.to(torch.int32),
        )
        output = self.model.propose(batch, self.context.caches, self.embed, self.lm_head,
                                    num_speculative_tokens)
        return output.tokens
