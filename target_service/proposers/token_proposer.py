"""TokenProposer: a proposer that drafts from the sequences' tokens on the host, beside the DFlash drafter.

The DFlash drafter (`DraftControl`) drafts from the draft context in the pool and sees only what the
step buffers carry; a lookup proposer reads the drafting sequences' tokens instead, so the runner
hands it those (`stage_sequences`) before every `propose`, and leaves the step buffers' propose side
(bonus tokens, start positions, sequence indices, block tables: what the DFlash drafter reads) to
it: the lookup never reads it, and the hybrid stages it only when the drafter runs
(`stage_propose_side`): four host-to-device copies a lookup step does not need (one cProfile run on
an H100 put them at 0.23 ms of a 1.85 ms profiled step: bench/results/proposers_held_rows_h100.md;
the step's speed-up is not measured). It meets the step the DFlash way in
every other respect: it writes `draft_tokens[:num_seqs, :num_draft]` and the same verify accepts
the longest prefix equal to the target's tokens, so whatever it proposes, the output is the
target's (greedy bit-equal, sampling unchanged).

Reading host tokens means a step cannot be launched from the device results of the step before it
(those tokens are not on the host yet): an engine with a token proposer schedules step by step.

After `propose`, `sources` names the proposer of each staged row, in order: the engine counts each
step's drafts and acceptance under it (`SpecDecodeStats.by_proposer`). After the step, `step_took`
hands it the step's time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from drafter_service.step_buffers import StepBuffers
from target_service.engine.sequence import Sequence

if TYPE_CHECKING:  # the runner's type, named in a signature only (the runner imports this module)
    from target_service.runner.context_rows import ContextRows

DFLASH = "dflash"  # drafts from the DFlash drafter
NGRAM = "ngram"  # drafts from prompt lookup


def stage_propose_side(buffers: StepBuffers, seqs: list[Sequence]) -> int:
    """The DFlash drafter's inputs for `seqs` (bonus token, start position, sequence index, block table
    of each) into the step buffers' propose side; returns the block-table columns used."""
    return buffers.stage_propose([seq.bonus_token for seq in seqs], [seq.num_computed for seq in seqs],
                                 [seq.seq_index for seq in seqs], [seq.block_table for seq in seqs])


class TokenProposer(ABC):
    """Implements `DraftControl` (block_size, store_context, settle, propose) plus `stage_sequences`."""

    stores_context = False  # whether its steps keep a draft context (the target's hidden states)

    def __init__(self, step_buffers: StepBuffers, *, block_size: int):
        self.step_buffers = step_buffers
        self._block_size = block_size
        self.staged: list[Sequence] = []
        self.sources: list[str] = []

    @property
    def block_size(self) -> int:
        """K + 1: a step verifies at most block_size - 1 drafts."""
        return self._block_size

    def stage_sequences(self, seqs: list[Sequence]) -> None:
        """The sequences of the rows the next `propose` drafts, in the staged order."""
        self.staged = list(seqs)

    def stage_propose_side(self, num_seqs: int) -> int:
        """Write the first `num_seqs` staged sequences into the step buffers' propose side, for the DFlash
        drafter; returns the block-table columns used."""
        return stage_propose_side(self.step_buffers, self.staged[:num_seqs])

    @abstractmethod
    def store_context(self, num_rows: int) -> None: ...

    @abstractmethod
    def settle(self) -> None: ...

    @abstractmethod
    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None: ...

    def defers_context(self, step_rows: int, num_rows: int, *, prefill_only: bool) -> bool:
        """Whether this step's num_rows context rows (of its step_rows tap rows; prefill_only: the step
        decoded nothing) are held back (`defer_context`) instead of staged and stored now (making
        room may store rows held before: it raises DrafterUnavailable as a store does): a proposer
        that keeps no context, or stores at once, says no."""
        return False

    def defer_context(self, context: ContextRows, owners: list[Sequence]) -> None:
        """Hold this step's context rows (on the device; on a GPU not picked yet) of the sequences
        `owners`, after `defers_context` said so."""
        raise NotImplementedError(f"{type(self).__name__} stores its context at once")

    def before_release(self) -> None:  # noqa: B027 (a hook; a proposer without deferred work has none)
        """Some sequence's pages are about to go back to the pool: anything that still writes into
        them (a deferred context store) must be done now."""

    def drop_deferred(self) -> None:  # noqa: B027 (likewise)
        """The pool restarted: forget anything held for the old pool's pages."""

    def step_took(self, num_seqs: int, seconds: float) -> None:  # noqa: B027 (likewise)
        """The step of the last `propose` took `seconds` (the engine times decode steps that ran back
        to back): for a proposer whose choice weighs what steps cost. Most do not."""
