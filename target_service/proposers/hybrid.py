"""HybridProposer: per sequence and step, the DFlash drafter's block or the prompt lookup's continuation.

Each wins where the other loses: DFlash on text like its training data, the lookup where the target
copies (its prompt, or itself). Each step, before anything is drafted, `choose_step` weighs the
expected tokens per second of a step with the DFlash drafter (each row verifying the better of its
two proposals) against one without it (every row on the lookup), from what each proposer is
expected to get accepted (below) and what such steps have cost on this machine (`StepClock`: the
engine hands each decode step's time to `step_took`, filed under whether that step ran the drafter;
`hybrid_choice.weighed_times` and `explore` keep one disturbed interval from deciding for good).
A step without the drafter skips it: that is where the lookup's speed comes from.

The draft context stays whole whichever proposer drafted: every accepted position's context is
stored from the verify's taps, so DFlash can take over at any step. A step that skipped the drafter,
or only prefilled, defers its store (`DeferredContext`): nothing reads the context until the drafter
next runs, so the held rows are stored together just before that, before any sequence's pages are
released (the engine's scheduler calls `before_release`), or when the next step's rows would not
fit (which are then held in their place).

"Expected accepted" is learned from what each sequence emitted. After a step, a sequence's new
tokens are the accepted drafts plus the target's next token, so:
- the proposer that drafted it accepted len(new) - 1 tokens;
- the lookup, whose proposal is on the host every step, would have accepted its proposal's common
  prefix with the new tokens (`lookup_outcome`): exact when it drafted, or when DFlash drafted and
  the lookup parted from the new tokens; when it matched every new token (DFlash's accepted drafts
  and the target's token after them) and proposed more, the value is only a lower bound, as the
  tokens past DFlash's rejection are unknown. Such a censored value may raise the lookup's score
  but never lowers it (`observe`): counted as exact, it would pull the lookup's score down to
  DFlash's acceptance plus one while DFlash drafts, however long the lookup's matches are. (On the
  demo pair this alone changed little: bench/results/proposers_h100.md.)
Each score is a moving average over the sequence's steps (weight `RECENT` on the newest). A sequence
with no score yet borrows the moving average over all sequences (weight `RECENT_OVERALL`), and before
anything was measured, K (optimism: a proposer never tried is tried). DFlash's score is observed only
when the drafter runs, so while the lookup drafts it is drawn back toward the average over sequences,
keeping `FORGET` of its distance per step: a score that stood still after a few bad drafter steps
shut DFlash out for the rest of a sequence, however well it would have done later (replayed on
recorded outcomes, `bench.hybrid_replay`: a batch of four held-out code prompts stayed on the lookup
for 49 steps where DFlash alone needed 31).

The lookup is scored by the kind of match its proposal came from, each kind learned apart: a long one
(at least `min_match` tokens, `LONG`), a short one (1 <= n < min_match, `SHORT`), and none (the
proposal repeats the last token: worth nothing, never scored). One score over all of them counted a
long match at the average of every step's, zeros of the steps without a match included. A short
match is no chance: with the demo pair on the bench's prompts (bench/results/hybrid_replay.md), the
lookup's 1-token matches had 1.8 and 2.1 drafts accepted a step on held-out code and edits, 10.5 on
prompts that repeat, where counting them as nothing ran the drafter on those steps. Unlike a long
match, a short one is not tried on optimism: until some short match's outcome is known it counts as
no match, as before.

All sequences still verify in one forward with one K (the uniform step): only the tokens differ.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from drafter_service.control import DraftControl, DrafterUnavailable
from drafter_service.step_buffers import StepBuffers
from foundation.host_transfer import to_device
from target_service.proposers.deferred_context import DeferredContext
from target_service.proposers.hybrid_choice import (
    RowOutlook,
    StepChoice,
    choose_step,
    explore,
    unanimous_choice,
    weighed_times,
)
from target_service.proposers.ngram import NgramLookups
from target_service.proposers.step_clock import Exploration, StepClock
from target_service.proposers.token_proposer import DFLASH, NGRAM, TokenProposer

logger = logging.getLogger(__name__)

RECENT = 0.5  # the newest step's weight in a sequence's score
RECENT_OVERALL = 0.1  # ... in the score over all sequences
FORGET = 0.95  # per step unobserved, what is left of a DFlash score's distance from the average


LONG, SHORT = "long", "short"  # the kinds of lookup match that are scored


@dataclass(slots=True)
class _Drafted:
    """What a sequence's last step was proposed: by whom, at which length, the lookup's tokens and
    the kind of its match (None: no match)."""

    source: str
    length: int  # the sequence's tokens when it was proposed (bonus included)
    lookup: list[int]
    match: str | None


@dataclass(slots=True)
class _Scores:
    long: float | None = None  # the lookup's, from long matches
    short: float | None = None  # ... from short ones
    dflash: float | None = None
    dflash_age: int = 0  # the sequence's steps since DFlash's score was last observed

    def lookup(self, kind: str) -> float | None:
        return self.long if kind == LONG else self.short

    def observe_lookup(self, kind: str, value: float, censored: bool, weight: float) -> None:
        if kind == LONG:
            self.long = observe(self.long, value, censored, weight)
        else:
            self.short = observe(self.short, value, censored, weight)


_NO_SCORES = _Scores()  # what a sequence never scored reads (never written)


def _moving(score: float | None, value: float, weight: float = RECENT) -> float:
    return value if score is None else (1 - weight) * score + weight * value


def _common_prefix(proposal: list[int], emitted: list[int]) -> int:
    differs = (i for i, (proposed, actual) in enumerate(zip(proposal, emitted)) if proposed != actual)
    return next(differs, min(len(proposal), len(emitted)))


def lookup_outcome(proposal: list[int], emitted: list[int], lookup_drafted: bool) -> tuple[int, bool]:
    """(drafts the lookup's proposal would have had accepted, whether that is only a lower bound).

    emitted: the sequence's new tokens after the step (accepted drafts, then the target's own token).
    Where DFlash drafted and the proposal agreed with every emitted token and went on, the target
    never judged the rest: at least that many."""
    accepted = _common_prefix(proposal, emitted)
    return accepted, not lookup_drafted and accepted == len(emitted) < len(proposal)


def observe(score: float | None, value: float, censored: bool, weight: float = RECENT) -> float:
    """The moving score after one more value; a censored value ("at least") never lowers it."""
    if censored and score is not None:
        value = max(value, score)
    return _moving(score, value, weight)


class HybridProposer(TokenProposer):
    stores_context = True  # the DFlash drafter's, whole, whichever proposer drafted

    def __init__(self, dflash: DraftControl, step_buffers: StepBuffers, *, min_ngram: int = 1,
                 max_ngram: int = 3, min_match: int = 2, clock: StepClock | None = None):
        super().__init__(step_buffers, block_size=dflash.block_size)
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"need 1 <= min_match <= max_ngram; got {min_match}, {max_ngram}")
        self.dflash = dflash
        self.lookups = NgramLookups(min_ngram=min_ngram, max_ngram=max_ngram)
        self.min_match = min_match
        self.clock = clock or StepClock()
        self.overall = _Scores()
        self._ran_drafter: bool | None = None  # the last propose's choice, until its step is timed
        self.deferred = DeferredContext(step_buffers)
        self._lookup_only_rows: int | None = None  # the rows of this step's store, if it may be deferred
        self._drafted: dict[int, _Drafted] = {}
        self._scores: dict[int, _Scores] = {}
        self.exploration = Exploration(self.clock)

    def defers_context(self, step_rows: int, num_rows: int, *, prefill_only: bool) -> bool:
        """The rows of a lookup-only step (its tap rows exactly its drafting rows) or of a step that
        only prefilled are held; a step that mixes the two, or whose rows did not all draft, stores at
        once, as do rows more than the hold's whole room. Where the held rows leave too little room,
        they are stored now and this step's are held in their place: one store, where storing this
        step's at once made two (its own, then the held rows', which `store_context` adds).
        A prompt's context held this way is stored with the rest, before the drafter first reads it
        or its pages go back: for a sequence the lookup serves throughout, one store instead of two.
        Raises DrafterUnavailable when the held rows' store could not be made."""
        lookup_only, self._lookup_only_rows = self._lookup_only_rows == step_rows, None
        if not (lookup_only or prefill_only) or num_rows > self.deferred.capacity:
            return False
        if not self.deferred.has_room(num_rows):
            self._store_deferred()
        return True

    def defer_context(self, context, owners) -> None:
        """Held straight from the step's rows: the step buffers are not written (nor waited for)."""
        self.deferred.hold(context, owners)

    def store_context(self, num_rows: int) -> None:
        """Store the staged rows, and everything held, now."""
        self._lookup_only_rows = None
        self.dflash.store_context(num_rows)
        self._store_deferred()

    def before_release(self) -> None:
        """Some sequence's pages go back to the pool now: store what is held while its slots are
        still its own (and its blocks, matchable as cached, get their context)."""
        try:
            self._store_deferred()
        except DrafterUnavailable as error:  # the owners were marked; the release goes on
            logger.warning("drafter unavailable while storing deferred context (%s)", error)

    def drop_deferred(self) -> None:
        """The pool restarted: the held rows' slots were the old pool's, and their sequences are
        recomputed."""
        self.deferred.clear()

    def _store_deferred(self) -> None:
        if not self.deferred.count:
            return
        owners = list(self.deferred.owners.values())
        try:
            self.dflash.settle()  # the context side may still be read by the store before
            num_rows, _ = self.deferred.stage(self.step_buffers)
            self.dflash.store_context(num_rows)
        except DrafterUnavailable:
            self.deferred.clear()
            for seq in owners:  # their context has a gap: they decode plainly until recomputed
                seq.has_context = False
            raise

    def settle(self) -> None:
        self.dflash.settle()

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        seqs = self.staged[:num_seqs]
        self._learn(seqs)
        if sum(seq.seq_id in self._scores for seq in seqs) < len(self._scores):  # some stopped drafting
            live = {seq.seq_id for seq in seqs}
            self._scores = {seq_id: score for seq_id, score in self._scores.items() if seq_id in live}
        matches = self.lookups.propose(seqs, num_draft)
        kinds = [self._kind(match) for match in matches]
        prior = _first_known(self.overall.dflash, num_draft)  # DFlash's, the same for every row
        outlooks = [self._outlook(seq.seq_id, kind, num_draft, prior) for seq, kind in zip(seqs, kinds)]
        choice = self._choose(outlooks)
        self._ran_drafter = choice.run_drafter
        self._lookup_only_rows = None if choice.run_drafter else num_seqs * (num_draft + 1)
        if choice.run_drafter:
            self._store_deferred()  # the drafter reads the whole context
            self.dflash.propose(num_seqs, num_draft, self.stage_propose_side(num_seqs))
        lookup_rows = choice.lookup_rows  # ascending
        if len(lookup_rows) == num_seqs:
            self.sources = [NGRAM] * num_seqs
        else:
            chosen = set(lookup_rows)
            self.sources = [NGRAM if row in chosen else DFLASH for row in range(num_seqs)]
        for seq, source, match, kind in zip(seqs, self.sources, matches, kinds):
            self._drafted[seq.seq_id] = _Drafted(source, seq.num_computed + 1, match.tokens, kind)
        if lookup_rows:
            self._write(list(lookup_rows), [matches[row].tokens for row in lookup_rows], num_draft)

    def _choose(self, outlooks: list[RowOutlook]) -> StepChoice:
        """`choose_step` over the clock's weighed times; every EXPLORE_EVERY-th step at a batch size,
        the kind measured longer ago instead."""
        num_seqs = len(outlooks)
        stale = self.exploration.due(num_seqs, (True, False))  # kinds: whether the drafter ran
        if stale is not None:
            return explore(outlooks, stale)
        unanimous = unanimous_choice(outlooks, bool(self.clock.intervals(num_seqs, True)))
        if unanimous is not None:
            return unanimous
        intervals = self.clock.intervals(num_seqs, True), self.clock.intervals(num_seqs, False)
        return choose_step(outlooks, *weighed_times(*intervals))

    @property
    def ran_drafter(self) -> bool:
        """Whether the last `propose` ran the DFlash drafter (read before its step is timed)."""
        return bool(self._ran_drafter)

    def step_took(self, num_seqs: int, seconds: float) -> None:
        """The step of the last propose took `seconds`: filed under whether it ran the drafter."""
        if self._ran_drafter is not None:
            self.clock.record(num_seqs, self._ran_drafter, seconds)
            self._ran_drafter = None

    def _kind(self, match) -> str | None:
        if match.ngram >= self.min_match:
            return LONG
        return SHORT if match.ngram > 0 else None

    def _outlook(self, seq_id: int, kind: str | None, num_draft: int, dflash_prior: float) -> RowOutlook:
        scores = self._scores.get(seq_id) or _NO_SCORES
        dflash = _dflash_outlook(scores, dflash_prior)
        if kind is None:
            return RowOutlook(dflash, None)
        optimism = num_draft if kind == LONG else None  # a short match untried counts as none
        return RowOutlook(dflash, _first_known(scores.lookup(kind), self.overall.lookup(kind), optimism))

    def _write(self, rows: list[int], tokens: list[list[int]], num_draft: int) -> None:
        buffers = self.step_buffers.draft_tokens
        values = to_device(tokens, buffers.dtype, buffers.device)  # queued: no wait on the drafter's kernels
        if rows == list(range(len(rows))):  # the common case: one copy, no index
            buffers[: len(rows), :num_draft].copy_(values)
            return
        buffers[to_device(rows, torch.int64, buffers.device), :num_draft] = values

    def _learn(self, seqs) -> None:
        """Score last step's proposals against what each sequence emitted since."""
        for seq in seqs:
            drafted = self._drafted.pop(seq.seq_id, None)
            length = seq.num_computed + 1
            if drafted is None or length <= drafted.length:
                continue
            emitted = seq.token_slice(drafted.length, length)
            scores = self._scores.setdefault(seq.seq_id, _Scores())
            if drafted.match is not None:
                lookup, censored = lookup_outcome(drafted.lookup, emitted, drafted.source == NGRAM)
                scores.observe_lookup(drafted.match, lookup, censored, RECENT)
                self.overall.observe_lookup(drafted.match, lookup, censored, RECENT_OVERALL)
            scores.dflash_age += 1
            if drafted.source == DFLASH:
                scores.dflash, scores.dflash_age = _moving(scores.dflash, len(emitted) - 1), 0
                self.overall.dflash = _moving(self.overall.dflash, len(emitted) - 1, RECENT_OVERALL)
        self._drafted = {}  # a sequence that does not draft this step starts over when it does


def _dflash_outlook(scores: _Scores, prior: float) -> float:
    """DFlash's expected accepted drafts for a sequence: its score, drawn back toward `prior` (the
    average over sequences) by FORGET for each of its steps since the score was last observed."""
    if scores.dflash is None:
        return prior
    return prior + (scores.dflash - prior) * FORGET**scores.dflash_age


def _first_known(*values: float | None) -> float | None:
    for value in values:
        if value is not None:
            return value
    return None
