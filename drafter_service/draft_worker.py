"""DraftWorker: the drafter service's domain object; whatever hosts the drafter only delegates to it.

It owns the draft model, the target's embedding and lm_head tables (loaded by the drafter from the
target checkpoint), the context storage and the attached step buffers, and implements
`DraftControl`: `store_context` after the target ran (taps of committed tokens -> context K/V) and
`propose` before the target verifies (noise block -> K draft tokens). Both read their inputs from
the step buffers and the drafts go back the same way.
"""

from __future__ import annotations

import torch

from drafter_service.draft_batch import DraftBatch
from drafter_service.model import DFlashDrafter
from drafter_service.step_buffers import StepBuffers


class DraftWorker:
    def __init__(self, model: DFlashDrafter, context, buffers: StepBuffers, *, embed: torch.Tensor,
                 lm_head: torch.Tensor):
        """context: a PagedContext or DenseContext; embed / lm_head: the target's [V, H] tables."""
        self.model = model
        self.context = context
        self.buffers = buffers
        self.embed = embed
        self.lm_head = lm_head
        self.graphs = None  # drafter_service.cuda_graphs.ProposeGraphs, set by the assembler on a GPU
        self.context_graphs = None  # drafter_service.context_graphs.ContextGraphs, likewise

    @property
    def block_size(self) -> int:
        return self.model.block_size

    def store_context(self, num_rows: int) -> None:
        self.buffers.check_context_rows(num_rows)
        if num_rows == 0:
            return
        if self.context_graphs is None or not self.context_graphs.run(num_rows):
            self.store_rows(num_rows)

    def store_rows(self, num_rows: int) -> None:
        """The context K/V of the first num_rows context rows into the draft layers' pages (rows with
        PAD_SLOT stored nowhere). Fixed shapes for a given num_rows, so `ContextGraphs` captures it."""
        b = self.buffers
        positions = b.context_positions[:num_rows]
        seq_indices, slots = b.context_seq_indices[:num_rows], b.context_slots[:num_rows]
        slots = self.context.slot_mapping(seq_indices, positions, slots)
        self.model.project_context(b.taps[:num_rows], positions, slots, self.context.caches)

    def settle(self) -> None:
        """Nothing is ever outstanding: every call runs to its end in the caller's thread."""

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        """Draft the whole block the drafter was trained on, and hand back its first num_draft tokens.

        A DFlash drafter learns to fill a block of block_size positions; a shorter noise block is out of
        its training distribution (the demo pair measured acceptance 3.4 at K 15 but 1.0 at K 7 with
        shortened blocks). Drafting the full block costs the same weights read for more rows.
        """
        self.buffers.check_propose(num_seqs, num_draft, num_block_cols)
        if self.graphs is None or not self.graphs.run(num_seqs):
            self.draft_rows(num_seqs, num_block_cols)

    def draft_rows(self, num_seqs: int, num_block_cols: int) -> None:
        """The whole block's drafts for the first num_seqs rows into draft_tokens[:num_seqs] (all
        block_size - 1 columns; the engine reads the first K). Fixed shapes for a given num_seqs and
        num_block_cols, so `ProposeGraphs` captures exactly this."""
        b = self.buffers
        starts, seq_indices = b.start_positions[:num_seqs], b.seq_indices[:num_seqs]
        batch = DraftBatch(
            bonus_tokens=b.bonus_tokens[:num_seqs], start_positions=starts,
            block_table=self.context.block_table(seq_indices, b.block_table[:num_seqs, :num_block_cols]),
            ctx_lens=starts.to(torch.int32),
        )
        output = self.model.propose(batch, self.context.caches, self.embed, self.lm_head, self.block_size - 1)
        b.draft_tokens[:num_seqs].copy_(output.tokens)
