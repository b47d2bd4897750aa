"""Where each sequence's rows land in a step's packed forward, planned on the host from ints.

A step packs verify blocks (decodes first) and prefill chunks into one forward. The engine needs,
per sequence, the slice of logits rows and of tap rows it owns, and for the drafts a `DraftIndex`
(which input row each draft fills, which logits row it is checked against). Two layouts: the one a
scheduled step packs (`scheduled_layout`, any mix, with its `SeqChunk`s for `pack`) and the one a
step launched ahead builds on the device (`uniform_layout`: B decodes of the same row count).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from target_service.engine.scheduler_output import SchedulerOutput
from target_service.engine.sequence import Sequence
from target_service.runner.forward_batch import SeqChunk
from target_service.runner.verify import DraftIndex


@dataclass(frozen=True)
class Rows:
    """Where one sequence's rows landed in the packed forward: `logits` the rows whose token the step
    chooses (a verify block, a new request's last prompt row), `prompt` the rows just before them
    whose logits give prompt logprobs (`PrefillChunk.prompt_logprob_positions`)."""

    logits: slice
    taps: slice
    prompt: slice = field(default_factory=lambda: slice(0, 0))


def scheduled_layout(plan: SchedulerOutput, verified: list[int], max_accepted: list[int], *, taps: bool,
                     width: int) -> tuple[list[SeqChunk], dict[int, Rows], DraftIndex]:
    """The packed forward's chunks (a decode's draft rows hold 0 until `place_drafts` fills them on
    the device), each sequence's rows, and the drafts' `DraftIndex`.

    verified: drafts each decode verifies; max_accepted: how many of them may count; taps: whether
    every row's taps are returned; width: the step buffers' draft_tokens columns.
    """
    chunks, index, input_row, logit_row, source_row = [], DraftIndex(), 0, 0, 0
    for work, num_verified, counted in zip(plan.decodes, verified, max_accepted):
        seq, num_rows = work.seq, 1 + num_verified
        chunks.append(SeqChunk([seq.bonus_token] + [0] * num_verified, seq.num_computed, seq.block_table,
                               num_rows, num_rows * taps))
        index.add_decode(num_verified, source_row=source_row, width=width, input_row=input_row,
                         logit_row=logit_row, max_accepted=counted)
        source_row += num_verified > 0  # the drafter's rows: the decodes that draft, in order
        logit_row, input_row = logit_row + num_rows, input_row + num_rows
    num_prompt = [0] * len(plan.decodes)
    for chunk in plan.prefills:
        seq, end = chunk.seq, chunk.start + chunk.num_tokens
        tokens = seq.token_slice(chunk.start, end)
        wants_logits = int(chunk.is_last and not seq.output_token_ids)
        positions = chunk.prompt_logprob_positions
        if positions and positions.stop != end - wants_logits:  # the logits rows are the chunk's last
            raise RuntimeError(f"prompt logprob positions {positions} are not the rows before the last "
                               f"{wants_logits} of a chunk ending at {end}")
        num_prompt.append(len(positions))
        chunks.append(SeqChunk(tokens, chunk.start, seq.block_table, len(positions) + wants_logits,
                               len(tokens) * taps, chunk.num_replayed))
    rows, logit_row, tap_row = {}, 0, 0
    for chunk, seq, prompt in zip(chunks, plan.seqs, num_prompt):
        rows[seq.seq_id] = Rows(slice(logit_row + prompt, logit_row + chunk.num_logits),
                                slice(tap_row, tap_row + chunk.num_taps),
                                slice(logit_row, logit_row + prompt))
        logit_row += chunk.num_logits
        tap_row += chunk.num_taps
    return chunks, rows, index


def uniform_layout(seqs: list[Sequence], num_verified: int, *, taps: bool,
                   width: int) -> tuple[dict[int, Rows], DraftIndex]:
    """Each of B decodes verifying `num_verified` drafts from draft_tokens row i: its rows and the
    `DraftIndex` (how many may count is decided on the device, so that is left to the caller)."""
    rows, index, q_len = {}, DraftIndex(), num_verified + 1
    for i, seq in enumerate(seqs):
        tap_rows = slice(i * q_len * taps, (i + 1) * q_len * taps)
        rows[seq.seq_id] = Rows(slice(i * q_len, (i + 1) * q_len), tap_rows)
        index.add_decode(num_verified, source_row=i, width=width, input_row=i * q_len, logit_row=i * q_len)
    return rows, index
