"""A response's own speculative-decoding stats, vLLM's `--per-request-spec-decode-metrics`.

Off by default, and then a response is byte for byte what it was: no `metrics` key at all (not a
null: `WithMetrics` drops it). "summary" adds, to a whole response and to a stream's final usage
chunk (the `choices: []` one that `stream_options.include_usage` asks for), a top-level
`metrics.speculative_decoding` made from the engine's `SpecDecodeStats` of the request; "detailed"
adds the per-step arrays too, which the engine keeps only for requests that ask
(`SamplingParams.spec_decode_per_step`), so a summary costs each request O(K) counters.

There is none (no `metrics`) as vLLM has none: for a request of more than one choice (n > 1, or
several prompts), whose choices each have their own stats; and without a drafter (K 0), where no
step drafts. A "spec step" is one verify step that checked at least one draft (`SpecDecodeStats`);
a request with a drafter but no spec step (max_tokens 1: the prefill's token alone) gets its zeros,
with a mean acceptance length of 1 and rates of 0.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field, model_serializer

from target_service.engine.outputs import SpecDecodeStats

SpecDecodeMetricsLevel = Literal["summary", "detailed"]
SPEC_DECODE_METRICS_LEVELS: tuple[str, ...] = get_args(SpecDecodeMetricsLevel)  # the CLI's choices


class ProposerAcceptance(BaseModel):
    """The spec steps one proposer drafted (an extension: a hybrid server's split of the totals)."""

    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    mean_acceptance_length: float


class SpeculativeDecodingMetrics(BaseModel):
    """One request's acceptance, as vLLM names it."""

    mean_acceptance_length: float = Field(description="1 + accepted drafts / spec steps: tokens per step")
    draft_acceptance_rate: float = Field(description="accepted drafts / drafts verified")
    acceptance_histogram: list[int] = Field(
        description="length num_spec_tokens + 1: [j] is the spec steps that accepted exactly j drafts")
    num_spec_steps: int = Field(description="verify steps that checked at least one draft")
    num_accepted_draft_tokens: int
    num_draft_tokens: int = Field(description="drafts verified over all spec steps")
    num_spec_tokens: int = Field(description="K, the drafts a step proposes")
    per_position_acceptance_rates: list[float] = Field(
        description="length num_spec_tokens: [i] is the spec steps whose draft i was accepted / spec steps")
    per_step_accepted: list[int] | None = Field(
        None, description="detailed only: the drafts each spec step accepted, in order")
    per_step_drafted: list[int] | None = Field(
        None, description="detailed only: the drafts each spec step verified, in order")
    per_proposer: dict[str, ProposerAcceptance] | None = Field(
        None, description="the same counts by who drafted (dflash, ngram): a hybrid's share of each")

    @model_serializer(mode="wrap")
    def _without_absent_steps(self, handler):
        data = handler(self)
        for name in ("per_step_accepted", "per_step_drafted", "per_proposer"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ResponseMetrics(BaseModel):
    speculative_decoding: SpeculativeDecodingMetrics


class WithMetrics(BaseModel):
    """A response body with an optional top-level `metrics`: left out of the JSON when None, so that
    a server with the flag off sends what it always sent, and otherwise last (after `usage`, where
    vLLM puts it; an inherited field would come first)."""

    metrics: ResponseMetrics | None = Field(
        None, description="this request's speculative-decoding stats: only with the server's "
                          "--per-request-spec-decode-metrics, one choice, and a drafter")

    @model_serializer(mode="wrap")
    def _without_absent_metrics(self, handler):
        data = handler(self)
        metrics = data.pop("metrics", None)
        if metrics is not None:
            data["metrics"] = metrics
        return data


def response_metrics(level: SpecDecodeMetricsLevel | None,
                     choices: list[SpecDecodeStats | None]) -> ResponseMetrics | None:
    """What a response carries for its choices' stats: None when off, for more than one choice, or
    without a drafter."""
    if level is None or len(choices) != 1 or choices[0] is None or choices[0].num_spec_tokens == 0:
        return None
    stats = speculative_decoding(choices[0], detailed=level == "detailed")
    return ResponseMetrics(speculative_decoding=stats)


def speculative_decoding(stats: SpecDecodeStats, *, detailed: bool) -> SpeculativeDecodingMetrics:
    k, steps = stats.num_spec_tokens, stats.num_drafts
    per_position = stats.accepted_per_position + [0] * (k - len(stats.accepted_per_position))
    return SpeculativeDecodingMetrics(
        mean_acceptance_length=stats.mean_acceptance_length,
        draft_acceptance_rate=stats.acceptance_rate,
        acceptance_histogram=list(stats.acceptance_histogram),
        num_spec_steps=steps,
        num_accepted_draft_tokens=stats.num_accepted_tokens,
        num_draft_tokens=stats.num_draft_tokens,
        num_spec_tokens=k,
        per_position_acceptance_rates=[count / steps if steps else 0.0 for count in per_position],
        # the engine kept them when the server asked (detailed); a summary leaves them out
        per_step_accepted=stats.per_step_accepted if detailed else None,
        per_step_drafted=stats.per_step_drafted if detailed else None,
        per_proposer={
            proposer: ProposerAcceptance(
                num_spec_steps=counts.num_drafts, num_draft_tokens=counts.num_draft_tokens,
                num_accepted_draft_tokens=counts.num_accepted_tokens,
                mean_acceptance_length=counts.mean_acceptance_length)
            for proposer, counts in sorted(stats.by_proposer.items())
        } or None,
    )
