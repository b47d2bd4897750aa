"""NgramProposer: prompt lookup over the prompt and the output so far, with no drafter.

Each sequence keeps an `NgramIndex` while it drafts; its proposal is the continuation of the latest
earlier occurrence of its last n tokens. No draft context is kept, so a step stores nothing. The
free baseline a trained drafter has to beat, and the half of `hybrid` that wins where the target
copies (edits of a given file, repeated JSON, a model that repeats itself).
"""

from __future__ import annotations

from drafter_service.step_buffers import StepBuffers
from foundation.host_transfer import to_device
from target_service.proposers.ngram_index import Match, NgramIndex
from target_service.proposers.token_proposer import NGRAM, TokenProposer


class NgramLookups:
    """One `NgramIndex` per drafting sequence (by seq_id), dropped once a sequence stops drafting."""

    def __init__(self, *, min_ngram: int, max_ngram: int):
        NgramIndex(min_ngram=min_ngram, max_ngram=max_ngram)  # the bounds checked once, here
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._indices: dict[int, NgramIndex] = {}

    def propose(self, seqs, num_draft: int) -> list[Match]:
        indices = {}
        for seq in seqs:
            indices[seq.seq_id] = self._indices.get(seq.seq_id) or NgramIndex(
                min_ngram=self.min_ngram, max_ngram=self.max_ngram)
        self._indices = indices  # a sequence that did not draft this step rebuilds its index later
        matches = []
        for seq in seqs:  # each index is shown only the tokens it has not seen
            index = indices[seq.seq_id]
            matches.append(index.propose_next(seq.token_slice(index.length, seq.num_computed + 1), num_draft))
        return matches


class NgramProposer(TokenProposer):
    def __init__(self, step_buffers: StepBuffers, *, block_size: int, min_ngram: int = 1, max_ngram: int = 3):
        super().__init__(step_buffers, block_size=block_size)
        self.lookups = NgramLookups(min_ngram=min_ngram, max_ngram=max_ngram)

    def store_context(self, num_rows: int) -> None:
        """Nothing to store: proposals are read off the tokens."""

    def settle(self) -> None:
        """Nothing is ever outstanding."""

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        matches = self.lookups.propose(self.staged[:num_seqs], num_draft)
        drafts = self.step_buffers.draft_tokens
        tokens = [match.tokens for match in matches]
        drafts[:num_seqs, :num_draft].copy_(to_device(tokens, drafts.dtype, drafts.device))
        self.sources = [NGRAM] * num_seqs
