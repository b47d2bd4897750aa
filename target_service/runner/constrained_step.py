"""ConstrainedStep: a step's part for the sequences under a grammar (structured outputs).

Before the forward, each constrained decode's drafts are read to the host and repaired
(`TokenConstraint.repair`: a rejected draft becomes the token the grammar forces there), and the
repaired ones written back, so the verify sees them. Then, while the forward runs, a worker thread
per sequence computes the masks of its rows (`TokenConstraint.masks`: llguidance releases the GIL,
and on a GPU the host is idle until the logits are read); choosing the target's tokens waits for
them and chooses from the masked logits. Unconstrained rows are untouched, and so are the raw
logits the logprobs are read from.

A step with no constrained sequence makes no ConstrainedStep and costs nothing.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from foundation.host_transfer import to_device
from target_service.engine.scheduler_output import SchedulerOutput

MASK_WORKERS = 4


class ConstrainedStep:
    def __init__(self, masks: dict[int, Future]):
        self._masks = masks  # seq_id -> its rows' allowed tokens [rows, vocab] bool, being computed

    @classmethod
    def begin(cls, plan: SchedulerOutput, verified: list[int], draft_tokens: torch.Tensor | None,
              executor: ThreadPoolExecutor) -> ConstrainedStep | None:
        """Repair the constrained decodes' drafts in `draft_tokens` (rows in the order of the decodes
        that draft) and start their masks; None when no sequence of the step is constrained."""
        if not any(seq.constraint is not None for seq in plan.seqs):
            return None
        drafting = [(work.seq, count) for work, count in zip(plan.decodes, verified) if count]
        needed = [row for row, (seq, _) in enumerate(drafting) if seq.constraint is not None]
        host = draft_tokens[: max(needed) + 1, : max(verified)].tolist() if needed else []
        blocks = {}
        for row in needed:
            seq, count = drafting[row]
            drafts = host[row][:count]
            repaired = seq.constraint.repair(drafts)
            if repaired != drafts:
                draft_tokens[row, :count] = to_device(repaired, draft_tokens.dtype, draft_tokens.device)
            blocks[seq.seq_id] = repaired
        choosing = [work.seq for work in plan.decodes]
        choosing += [chunk.seq for chunk in plan.prefills if chunk.is_last]
        masks = {seq.seq_id: executor.submit(seq.constraint.masks, blocks.get(seq.seq_id, []))
                 for seq in choosing if seq.constraint is not None}
        return cls(masks)

    def masks(self, seq_id: int) -> bool:
        """Whether the sequence's rows are masked this step."""
        return seq_id in self._masks

    def masked(self, seq_id: int, logits: torch.Tensor) -> torch.Tensor:
        """The sequence's logits rows (`masks` true of it) with what its grammar forbids at -inf."""
        allowed = self._masks[seq_id].result()[: logits.shape[0]].to(logits.device, non_blocking=True)
        return logits.masked_fill(~allowed, float("-inf"))


def mask_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=MASK_WORKERS, thread_name_prefix="dflash-grammar")
