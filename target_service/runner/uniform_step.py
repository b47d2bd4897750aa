"""The inputs of a step launched ahead, built on the device from the step before it.

In the steady state (every running sequence decoding, `Scheduler.schedule_ahead`) the next step's
inputs are functions of the current step's device results: each sequence's next bonus is the
target's token after its accepted drafts, and its next start is its start plus the accepted drafts
plus one. So the next propose and forward are queued at once, and the host reads the current step's
tokens, checks stops and commits while the GPU runs the next one.
"""

from __future__ import annotations

import torch

from target_service.engine.draft_budget import DraftBudget
from target_service.runner.forward_batch import ForwardBatch


def next_inputs(targets: torch.Tensor, accepted: torch.Tensor | None, logit_starts: torch.Tensor,
                starts: torch.Tensor, remaining: torch.Tensor, budget: DraftBudget):
    """Each decode's next bonus token, start position and drafts that may count [B], from the current
    step's device results: the target's token after its accepted drafts, at start + accepted + 1; the
    `DraftBudget` of that state (remaining: max_tokens minus the outputs before the current step,
    which emits accepted + 1 more)."""
    if accepted is None:
        accepted = torch.zeros_like(starts)
    next_starts = starts + accepted + 1
    max_accepted = budget.max_accepted_on_device(next_starts, remaining - accepted - 1)
    return targets[logit_starts + accepted], next_starts, max_accepted


def uniform_decode_batch(bonus: torch.Tensor, starts: torch.Tensor, block_table: torch.Tensor,
                         num_verified: int, tokens_per_block: int, taps: bool) -> ForwardBatch:
    """The forward of B decodes verifying `num_verified` drafts each, built on the device from their
    bonus tokens and starts [B] and block tables [B, M] int32; the draft rows hold 0 until
    `DeviceDraftIndex.place_drafts` fills them."""
    num_seqs, q_len, device = bonus.shape[0], num_verified + 1, bonus.device
    input_ids = torch.zeros(num_seqs, q_len, dtype=torch.int64, device=device)
    input_ids[:, 0] = bonus
    positions = starts[:, None] + torch.arange(q_len, device=device)
    blocks = block_table.gather(1, positions // tokens_per_block).to(torch.int64)
    rows = torch.arange(num_seqs * q_len, device=device)
    return ForwardBatch(
        input_ids=input_ids.view(-1), positions=positions.view(-1),
        slot_mapping=(blocks * tokens_per_block + positions % tokens_per_block).view(-1),
        block_table=block_table, seq_lens=(starts + q_len).to(torch.int32),
        query_start_loc=torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device=device),
        logits_indices=rows, tap_indices=rows if taps else rows[:0],
    )
