"""The token proposers as step-bench modes: prompt lookup, and the hybrid free or pinned to the lookup.

`dflash bench step --modes ngram hybrid-lookup hybrid` times them beside plain decode and DFlash on the
same geometry and simulated acceptance: with acceptance simulated, a step emits what the curve says
whoever drafted, so the modes differ only in what a step costs. `hybrid-lookup` is the hybrid with its
choice pinned to the lookup on every row of every step (`pin_to_lookup`): it drafts what ngram drafts
and never runs the drafter, but keeps the drafter's context whole from the verify's taps, so its step
against ngram's is what the hybrid's bookkeeping costs on that geometry. (On the bench's random prompts
the free hybrid's lookup has few matches to offer, so it is expected to run the drafter on most steps:
against DFlash's it shows that side of the choice.)
"""

from __future__ import annotations

from target_service.proposers.hybrid import HybridProposer
from target_service.proposers.hybrid_choice import explore

TOKEN_MODES = ("ngram", "hybrid-lookup", "hybrid")


def speculative_method(mode: str) -> str | None:
    """The engine's speculative_method for a bench mode (None: plain decoding)."""
    return {"plain": None, "hybrid-lookup": "hybrid"}.get(mode, mode)


def uses_drafter(mode: str) -> bool:
    return speculative_method(mode) in ("dflash", "hybrid")


def pin_to_lookup(llm) -> None:
    """Make a hybrid engine verify the lookup's proposal on every row of every step, never running the
    drafter (its context is still kept whole)."""
    proposer = llm.assembly.runner.drafter
    if not isinstance(proposer, HybridProposer):
        raise TypeError(f"not a hybrid engine: its proposer is {type(proposer).__name__}")
    proposer._choose = lambda outlooks: explore(outlooks, run_drafter=False)  # every row on the lookup
