"""Prompt lookup (n-gram) drafting: the free baseline a trained drafter has to beat.

For each sequence, find the most recent earlier occurrence of its last n tokens (n from
`max_ngram` down to `min_ngram`) and propose the K tokens that followed it, copying on through the
proposal itself when the match runs into the present (so a periodic run continues its period).
It plugs into the engine where the DFlash DraftWorker sits (`store_context` / `propose`), so its
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

    def __init__(self, engine, *, max_ngram: int = 3, min_ngram: int = 1):
        self.engine = engine
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.block_size = engine.drafter.block_size if engine.drafter is not None else 16

    def store_context(self, taps, positions, seq_slots, target_slots) -> None:
        """Nothing to store: the proposal is read off the tokens."""

    def propose(self, bonus_tokens, start_positions, seq_slots, target_block_table, num_speculative_tokens):
        by_slot = {seq.slot: seq for seq in self.engine.scheduler.running}
        rows = []
        for slot, start in zip(seq_slots.tolist(), start_positions.tolist()):
            tokens = by_slot[slot].token_ids[: start + 1]  # up to and including the bonus
            rows.append(lookup(tokens, num_speculative_tokens, max_ngram=self.max_ngram,
                               min_ngram=self.min_ngram))
        return torch.tensor(rows, dtype=torch.long, device=start_positions.device)
