"""HybridProposer: per sequence and step, the DFlash drafter's block or the prompt lookup's continuation.

Each wins where the other loses: DFlash on text like its training data, the lookup where the target
copies (its prompt, or itself). Every step the DFlash drafter drafts for all rows (its context must
stay whole so it can take over at any step: the verify stores every accepted position's context
whichever proposer drafted it); then, per sequence, the lookup's continuation replaces DFlash's
block when the lookup matched at least `min_match` tokens and has lately done better.

"Lately better" is judged from what the sequence emitted. After a step, a sequence's new tokens are
the accepted drafts plus the target's next token, so:
- the proposer that drafted it accepted len(new) - 1 tokens;
- the lookup, whose proposal is on the host every step, would have accepted its proposal's common
  prefix with the new tokens: exact when it drafted, and when DFlash drafted a lower bound (at most
  one more than DFlash's, as the tokens past DFlash's rejection are unknown), so the lookup takes
  over only where it would have matched everything DFlash accepted and the token after.
Each score is a moving average over the sequence's steps (weight `RECENT` on the newest); DFlash's
stands still while the lookup drafts. Ties go to DFlash.

All sequences still verify in one forward with one K (the uniform step): only the tokens differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter_service.control import DraftControl
from drafter_service.step_buffers import StepBuffers
from target_service.proposers.ngram import NgramLookups
from target_service.proposers.token_proposer import DFLASH, NGRAM, TokenProposer

RECENT = 0.5  # the newest step's weight in a score


@dataclass
class _Drafted:
    """What a sequence's last step was proposed: by whom, at which length, the lookup's tokens."""

    source: str
    length: int  # the sequence's tokens when it was proposed (bonus included)
    lookup: list[int]


@dataclass
class _Scores:
    lookup: float | None = None
    dflash: float | None = None


def _moving(score: float | None, value: float) -> float:
    return value if score is None else (1 - RECENT) * score + RECENT * value


def _common_prefix(proposal: list[int], emitted: list[int]) -> int:
    differs = (i for i, (proposed, actual) in enumerate(zip(proposal, emitted)) if proposed != actual)
    return next(differs, min(len(proposal), len(emitted)))


class HybridProposer(TokenProposer):
    stores_context = True  # the DFlash drafter's, whole, whichever proposer drafted

    def __init__(self, dflash: DraftControl, step_buffers: StepBuffers, *, min_ngram: int = 1,
                 max_ngram: int = 3, min_match: int = 2):
        super().__init__(step_buffers, block_size=dflash.block_size)
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"need 1 <= min_match <= max_ngram; got {min_match}, {max_ngram}")
        self.dflash = dflash
        self.lookups = NgramLookups(min_ngram=min_ngram, max_ngram=max_ngram)
        self.min_match = min_match
        self._drafted: dict[int, _Drafted] = {}
        self._scores: dict[int, _Scores] = {}

    def store_context(self, num_rows: int) -> None:
        self.dflash.store_context(num_rows)

    def settle(self) -> None:
        self.dflash.settle()

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        seqs = self.staged[:num_seqs]
        self._learn(seqs)
        self.dflash.propose(num_seqs, num_draft, num_block_cols)
        matches = self.lookups.propose(seqs, num_draft)
        sources, chosen_rows, chosen_tokens = [], [], []
        for row, (seq, match) in enumerate(zip(seqs, matches)):
            scores = self._scores.setdefault(seq.seq_id, _Scores())
            use_lookup = (match.ngram >= self.min_match and scores.lookup is not None
                          and (scores.dflash is None or scores.lookup > scores.dflash))
            sources.append(NGRAM if use_lookup else DFLASH)
            if use_lookup:
                chosen_rows.append(row)
                chosen_tokens.append(match.tokens)
            self._drafted[seq.seq_id] = _Drafted(sources[-1], seq.num_computed + 1, match.tokens)
        if chosen_rows:
            buffers = self.step_buffers.draft_tokens
            rows = torch.tensor(chosen_rows, dtype=torch.int64, device=buffers.device)
            buffers[rows, :num_draft] = torch.tensor(chosen_tokens, dtype=buffers.dtype).to(buffers.device)
        self.sources = sources
        live = {seq.seq_id for seq in seqs}
        self._scores = {seq_id: score for seq_id, score in self._scores.items() if seq_id in live}

    def _learn(self, seqs) -> None:
        """Score last step's proposals against what each sequence emitted since."""
        for seq in seqs:
            drafted = self._drafted.pop(seq.seq_id, None)
            length = seq.num_computed + 1
            if drafted is None or length <= drafted.length:
                continue
            emitted = seq.token_ids[drafted.length:length]
            scores = self._scores.setdefault(seq.seq_id, _Scores())
            scores.lookup = _moving(scores.lookup, _common_prefix(drafted.lookup, emitted))
            if drafted.source == DFLASH:
                scores.dflash = _moving(scores.dflash, len(emitted) - 1)
        self._drafted = {}  # a sequence that does not draft this step starts over when it does
