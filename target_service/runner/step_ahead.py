"""The next step, launched before the host has read the current one (overlap of host and GPU).

In the steady state (every running sequence decoding, nobody waiting) the next step's inputs are
functions of the current step's device results: each sequence's next bonus is the target's token
after its accepted drafts, and its next start is its start plus the accepted drafts plus one. So
the next propose and forward are queued on the device at once, and the host reads the current
step's tokens, checks stops and commits while the GPU runs the next one. What the host cannot know
yet it bounds: pages are reserved for the longest outcome (every draft accepted), and a sequence
that finishes in the current step runs one step too many, whose results are dropped.

The step ahead is taken only when it is the step the scheduler would plan after the current one:
same sequences, each verifying K drafts whatever the current step accepts (max_model_len far enough
away), within the token budget, without preempting, nobody to admit (none waiting, or every slot
taken: a request waiting for a slot that the current step frees is admitted one step later); and only
for greedy requests or those with their own generator, so the engine's shared generator is never
drawn for a step that is dropped. How many of its drafts may count (fewer near max_tokens) the
device decides with the scheduler's rule. Anything else waits for the current step and is scheduled
as usual.
"""

from __future__ import annotations

import torch

from kvpool_service.control import ReserveRequest
from kvpool_service.errors import PoolExhausted
from target_service.engine.scheduler import DecodeWork, Scheduler, SchedulerOutput
from target_service.runner.forward_batch import ForwardBatch


def plan_ahead(scheduler: Scheduler, current: SchedulerOutput, num_drafts: list[int],
               num_draft: int) -> SchedulerOutput | None:
    """The step after `current` (whose decodes verified `num_drafts`) with every decode verifying
    `num_draft`, when it can be planned now, reserving its pages for the longest outcome of
    `current`; None when it cannot."""
    seqs = [work.seq for work in current.decodes]
    if current.prefills or current.preempted or not seqs:
        return None
    if scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
        return None  # a waiting request would be admitted (with every slot taken, it waits a step later)
    if len(seqs) != len(scheduler.running) or set(map(id, seqs)) != set(map(id, scheduler.running)):
        return None
    if len(seqs) * (num_draft + 1) > scheduler.max_num_batched_tokens:
        return None
    requests = []
    for seq, drafted in zip(seqs, num_drafts):
        longest = seq.num_computed + drafted + 1  # num_computed after `current` accepts every draft
        if num_draft and not seq.has_context:
            return None
        if not (seq.params.greedy or seq.generator is not None):
            return None
        if longest + num_draft + 2 > scheduler.max_model_len:
            return None  # the scheduler might verify fewer rows (`Scheduler.num_proposed_tokens`)
        requests.append(ReserveRequest(seq.seq_id, longest + num_draft + 1))
    try:
        appended = scheduler.pool.reserve(requests)
    except PoolExhausted:
        return None  # the scheduler would preempt: let it, after the current step
    for seq, blocks in zip(seqs, appended):
        seq.block_table.extend(blocks)
    # how many of the drafts may count is decided on the device (`next_inputs`): K is the bound
    return SchedulerOutput(decodes=[DecodeWork(seq, num_draft, num_draft) for seq in seqs])


def next_inputs(targets: torch.Tensor, accepted: torch.Tensor | None, logit_starts: torch.Tensor,
                starts: torch.Tensor, remaining: torch.Tensor, num_draft: int, max_model_len: int):
    """Each decode's next bonus token, start position and drafts that may count [B], from the current
    step's device results: the target's token after its accepted drafts, at start + accepted + 1;
    `Scheduler.num_draft_tokens` of that state (remaining: max_tokens minus the outputs before the
    current step)."""
    if accepted is None:
        accepted = torch.zeros_like(starts)
    next_starts = starts + accepted + 1
    limit = torch.minimum(max_model_len - next_starts - 2, remaining - accepted - 2)
    return targets[logit_starts + accepted], next_starts, limit.clamp(min=0, max=num_draft)


def uniform_decode_batch(bonus: torch.Tensor, starts: torch.Tensor, block_table: torch.Tensor,
                         num_draft: int, tokens_per_block: int, taps: bool) -> ForwardBatch:
    """The forward of B decodes verifying `num_draft` drafts each, built on the device from their
    bonus tokens and starts [B] and block tables [B, M] int32; the draft rows hold 0 until
    `DeviceDraftIndex.place_drafts` fills them."""
    num_seqs, q_len, device = bonus.shape[0], num_draft + 1, bonus.device
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
