"""Prompt lookup (n-gram) drafting: the free baseline a trained drafter has to beat.

For each sequence, find the most recent earlier occurrence of its last n tokens (n from
`max_ngram` down to `min_ngram`) and propose the K tokens that followed it, copying on through the
proposal itself when the match runs into the present (so a periodic run continues its period).
It plugs into the engine where the DFlash DraftWorker sits (`DraftControl`), so its
acceptance is measured by the same verify step, on the same prompts.
"""

from __future__ import annotations

import torch


def lookup(tokens: list[int], num_draft: int, *, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """K proposed tokens after `tokens` (the sequence so far, bonus last); repeats the last on no match."""
    if num_draft < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need num_draft >= 1 and 1 <= min_ngram <= max_ngram; got {num_draft}, "
                         f"{min_ngram}, {max_ngram}")
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start:start + n] == pattern:
                extended = list(tokens)
                for j in range(num_draft):  # copy forward, through the proposal when needed
                    extended.append(extended[start + n + j])
                return extended[length:]
    return [tokens[-1]] * num_draft


class PromptLookupDrafter:
    """Engine drafter double: proposes by `lookup` over each sequence's tokens; stores nothing."""

    def __init__(self, engine, step_buffers, *, block_size: int, max_ngram: int = 3, min_ngram: int = 1):
        """engine: the `LLMEngine` whose running sequences it reads; step_buffers: its runner's."""
        self.engine, self.step_buffers = engine, step_buffers
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.block_size = block_size

    def store_context(self, num_rows: int) -> None:
        """Nothing to store: the proposal is read off the tokens."""

    def settle(self) -> None:
        """Nothing is ever outstanding."""

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        """Drafts for the step buffers' first num_seqs sequences, written where the engine reads them."""
        buffers = self.step_buffers
        by_index = {seq.seq_index: seq for seq in self.engine.running_sequences()}
        rows = []
        indices, starts = buffers.seq_indices[:num_seqs].tolist(), buffers.start_positions[:num_seqs].tolist()
        for seq_index, start in zip(indices, starts):
            tokens = by_index[seq_index].token_ids[: start + 1]  # up to and including the bonus
            rows.append(lookup(tokens, num_draft, max_ngram=self.max_ngram, min_ngram=self.min_ngram))
        buffers.draft_tokens[:num_seqs, :num_draft].copy_(torch.tensor(rows))
