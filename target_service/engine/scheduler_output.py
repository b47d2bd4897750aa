"""What the scheduler hands the step: prefill chunks and verify blocks, plain references to sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from target_service.engine.sequence import Sequence


@dataclass(frozen=True)
class PrefillChunk:
    """Positions start .. start+num_tokens-1 of `seq` go through the target this step.

    The first `num_replayed` of them are in the pages already (below `seq.num_computed`): they run
    again only for the logits a prompt logprob needs, and store nothing. `prompt_logprob_positions`:
    the positions whose logits give a prompt token's logprob (`Sequence.prompt_logprob_positions`).
    """

    seq: Sequence
    start: int
    num_tokens: int
    num_replayed: int = 0
    prompt_logprob_positions: range = range(0)

    @classmethod
    def next_of(cls, seq: Sequence, budget: int) -> PrefillChunk:
        """`seq`'s next chunk, at most `budget` tokens, from `Sequence.prefill_start`."""
        start = seq.prefill_start
        num_tokens = min(budget, seq.prefill_len - start)
        return cls(seq, start, num_tokens, max(0, min(seq.num_computed - start, num_tokens)),
                   seq.prompt_logprob_positions(start, start + num_tokens))

    @property
    def is_last(self) -> bool:
        return self.start + self.num_tokens == self.seq.prefill_len


@dataclass(frozen=True)
class DecodeWork:
    """One speculative step of `seq`: verify `num_verified` drafts (num_verified + 1 rows), of which
    at most the first `max_accepted` may be accepted (`DraftBudget`)."""

    seq: Sequence
    num_verified: int
    max_accepted: int


@dataclass
class SchedulerOutput:
    decodes: list[DecodeWork] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def seqs(self) -> list[Sequence]:
        """Sequences in the packed order: verify blocks first, then prefill chunks."""
        return [work.seq for work in self.decodes] + [chunk.seq for chunk in self.prefills]
