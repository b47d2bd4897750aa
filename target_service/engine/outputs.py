"""What generation returns, shaped like vLLM's `RequestOutput`, plus speculative-decoding stats and
per-token log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one token at its position, and the most likely tokens there.

    top_token_ids, top_logprobs: the request's N most likely tokens at that position (N =
    `SamplingParams.logprobs`, or `prompt_logprobs` for a prompt token), most likely first; the
    token's own value is `logprob`, computed from the same row, so a greedy token's logprob equals
    top_logprobs[0] exactly.
    """

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS, stop token or stop string), "length", "abort", or "error" (this request's own part
    # of a step failed; the others went on)
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked


@dataclass
class SpecDecodeStats:
    """Per request or engine-wide; mean acceptance length = 1 + accepted / drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position += [0] * (num_draft - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        """Add `other`'s counts to these (per position too): a total over requests."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        longer = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(0, longer)
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
        }


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_decode: SpecDecodeStats
    # one per prompt token (the first None: nothing predicts it), when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None
