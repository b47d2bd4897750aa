"""The proposer a plan's `speculative_method` names, made from the drafter it was given (if any)."""

from __future__ import annotations

from drafter_service.control import DraftControl
from drafter_service.step_buffers import StepBuffers
from target_service.proposers.hybrid import HybridProposer
from target_service.proposers.ngram import NgramProposer


def make_proposer(plan, drafter: DraftControl | None, buffers: StepBuffers | None) -> DraftControl | None:
    """plan: an `EnginePlan`. "dflash": the drafter as it is; "ngram": prompt lookup into the step
    buffers; "hybrid": both, chosen per sequence and step; None: no proposer (plain decoding)."""
    method, args = plan.speculative_method, plan.args
    lookup = dict(min_ngram=args.prompt_lookup_min, max_ngram=args.prompt_lookup_max)
    if method == "ngram":
        return NgramProposer(buffers, block_size=plan.block_size, **lookup)
    if method == "hybrid":
        return HybridProposer(drafter, buffers, min_match=min(2, args.prompt_lookup_max), **lookup)
    return drafter
