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
    """Per request or engine-wide; mean acceptance length = 1 + accepted / drafts.

    A "draft" (vLLM's name) is one verify step that checked at least one drafted token; a step that
    verified none (plain decoding, the last token of max_tokens) is not counted anywhere here.

    acceptance_histogram[j]: drafts that accepted exactly j tokens, dense (length K + 1 for a request,
    `for_request`; it grows as needed otherwise): O(K) memory, so it is always kept.
    per_step_accepted / per_step_drafted: each draft's accepted and verified counts in order, kept only
    for a request whose `SamplingParams.spec_decode_per_step` asks (None otherwise): they grow with
    the output, and only the server's `--per-request-spec-decode-metrics detailed` reads them.
    by_proposer: the same counts split by who drafted the step ("dflash", "ngram"): a hybrid
    proposer's share of each, which the totals alone hide.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_histogram: list[int] = field(default_factory=list)
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None
    by_proposer: dict[str, SpecDecodeStats] = field(default_factory=dict)

    @classmethod
    def for_request(cls, num_spec_tokens: int, *, per_step: bool = False) -> SpecDecodeStats:
        """A request's empty counters: a histogram of K + 1 bins (one bin without a drafter, K 0),
        and the per-step lists when asked."""
        return cls(acceptance_histogram=[0] * (num_spec_tokens + 1),
                   per_step_accepted=[] if per_step else None, per_step_drafted=[] if per_step else None)

    @property
    def num_spec_tokens(self) -> int:
        """K, as the histogram knows it (0: no drafter, or nothing recorded yet engine-wide)."""
        return max(0, len(self.acceptance_histogram) - 1)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, num_draft: int, num_accepted: int, proposer: str | None = None) -> None:
        """One verify step that checked `num_draft` drafts and accepted the first `num_accepted`;
        `proposer` (who drafted them) counts it in `by_proposer` too."""
        if num_draft == 0:
            return
        if proposer is not None:
            self.by_proposer.setdefault(proposer, SpecDecodeStats()).record(num_draft, num_accepted)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        _grow(self.accepted_per_position, num_draft)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        _grow(self.acceptance_histogram, num_accepted + 1)
        self.acceptance_histogram[num_accepted] += 1
        if self.per_step_accepted is not None:
            self.per_step_accepted.append(num_accepted)
            self.per_step_drafted.append(num_draft)

    def merge(self, other: SpecDecodeStats) -> None:
        """Add `other`'s counts to these (per position and per bin too): a total over requests. The
        per-step lists are one request's order and are not merged."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.acceptance_histogram, other.acceptance_histogram)):
            _grow(mine, len(theirs))
            for index, count in enumerate(theirs):
                mine[index] += count
        for proposer, counts in other.by_proposer.items():
            self.by_proposer.setdefault(proposer, SpecDecodeStats()).merge(counts)

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position), list(self.acceptance_histogram),
                               _copied(self.per_step_accepted), _copied(self.per_step_drafted),
                               {proposer: counts.copy() for proposer, counts in self.by_proposer.items()})

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "by_proposer": {proposer: counts.as_dict() for proposer, counts in self.by_proposer.items()},
        }


def _grow(counts: list[int], length: int) -> None:
    """Pad `counts` with zeros to at least `length` entries, in place."""
    counts += [0] * max(0, length - len(counts))


def _copied(values: list[int] | None) -> list[int] | None:
    return None if values is None else list(values)


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
