"""DraftControl: the calls a step makes on the drafter, whatever process the drafter lives in.

The data of a step is in the step buffers (`drafter_service.step_buffers`) both sides map; a call
carries only row counts. The in-process `DraftWorker` implements it; a drafter in another process
implements it with the same meaning over a channel that carries the same counts.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class DrafterUnavailable(RuntimeError):
    """The drafter cannot serve this call (its process died or is restarting).

    Raised by a DraftControl whose drafter lives elsewhere; the engine then runs the step without
    speculation and the sequences of that step decode plainly until recomputed. Never raised by
    the in-process worker.
    """


@runtime_checkable
class DraftControl(Protocol):
    @property
    def block_size(self) -> int:
        """The noise block the drafter was trained on; a step verifies at most block_size - 1 drafts."""
        ...

    def store_context(self, num_rows: int) -> None:
        """Project the first `num_rows` rows of the context side into the draft context.

        Rows whose `context_slots` is PAD_SLOT are skipped (drafts the target rejected).
        """
        ...

    def settle(self) -> None:
        """Return once the drafter is done with every call made so far, so the step buffers' inputs
        may be written again (a drafter in another process may still be storing the last context)."""
        ...

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        """Draft for the first `num_seqs` rows of the propose side; write `draft_tokens[:, :num_draft]`.

        num_block_cols: the block-table columns staged (the longest table of the batch).
        """
        ...
