"""The target's log-probabilities of a step's tokens, for the requests that ask (`SamplingParams`'
`logprobs`, `prompt_logprobs`), from the logits the step already has.

A verify block's rows give the log-probability of the target's token after the bonus and after each
draft (the engine keeps those of the tokens it emits), a new request's last prompt row its first
token's, and a prompt-logprob request's prefill rows the prompt token after each of them. The host
plans which logits rows and which tokens (`plan_logprob_rows`, plain ints) before any kernel runs; the
device computes each row's distribution (log_softmax of the logits, or the sampler's filtered one for
`logprobs_mode="processed"`, one request at a time), gathers the token's value and the top N, and packs
them into one float32 tensor [M, 2 + 2N] that reaches the host in one copy. Token ids ride in it as
floats: exact below 2**24, far above any vocabulary. A step where nobody asked does nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foundation.host_transfer import HostReadback, to_device
from target_service.engine.outputs import TokenLogprob
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.scheduler_output import SchedulerOutput
from target_service.runner.sampling import filtered_logprobs
from target_service.runner.step_layout import Rows

STEP_TOKEN = -1  # a row whose token is the step's own choice there (the target's, or a sample)
MAX_ROWS_PER_PASS = 256  # rows per log_softmax: bounds the float32 copy of a long prompt's logits
MAX_EXACT_TOKEN_ID = 2**24  # token ids below it are exact as float32


@dataclass
class LogprobRows:
    """Which logits rows of a step get log-probabilities, grouped by the distribution they use.

    rows: logits rows; tokens: per row, the token whose value is wanted (STEP_TOKEN: the step's own
    choice at that row); groups: (start, stop, params) ranges of `rows`, params None for the raw rows
    (all of them in one range) or a processed request's SamplingParams; num_top: the largest N asked;
    spans: (seq_id, "output" | "prompt") -> (start, stop, N) in `rows`.
    """

    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    groups: list[tuple[int, int, SamplingParams | None]] = field(default_factory=list)
    num_top: int = 0
    spans: dict[tuple[int, str], tuple[int, int, int]] = field(default_factory=dict)

    def add(self, key: tuple[int, str], rows: range, tokens: list[int], num_top: int) -> None:
        start = len(self.rows)
        self.rows += rows
        self.tokens += tokens
        self.spans[key] = (start, len(self.rows), num_top)
        self.num_top = max(self.num_top, num_top)


def plan_logprob_rows(plan: SchedulerOutput, rows: dict[int, Rows]) -> LogprobRows | None:
    """The step's logprob rows: every logits row of a sequence with `logprobs` (a verify block's, a
    last prompt row), and the prompt rows of a chunk with `prompt_logprob_positions`; None when no
    row of the step is one of them."""
    prompts = {chunk.seq.seq_id: chunk.prompt_logprob_positions for chunk in plan.prefills}
    asking = [seq for seq in plan.seqs if seq.params.logprobs is not None or prompts.get(seq.seq_id)]
    if not asking:
        return None
    out = LogprobRows()
    raw = [seq for seq in asking if seq.params.logprobs_mode == "raw"]
    for group in [raw] + [[seq] for seq in asking if seq.params.logprobs_mode != "raw"]:
        start = len(out.rows)
        for seq in group:
            own = rows[seq.seq_id]
            chosen = range(own.logits.start, own.logits.stop)
            if seq.params.logprobs is not None and chosen:
                out.add((seq.seq_id, "output"), chosen, [STEP_TOKEN] * len(chosen), seq.params.logprobs)
            positions = prompts.get(seq.seq_id)
            if positions:
                following = [seq.prompt_token_ids[position + 1] for position in positions]
                out.add((seq.seq_id, "prompt"), range(own.prompt.start, own.prompt.stop), following,
                         seq.params.prompt_logprobs)
        if len(out.rows) > start:
            out.groups.append((start, len(out.rows), None if group is raw else group[0].params))
    return out if out.rows else None


@dataclass
class StepLogprobs:
    """A step's logprob rows on their way to the host: [M, 2 + 2N] float32 per row (token, its
    logprob, the top N values, the top N ids)."""

    plan: LogprobRows
    readback: HostReadback

    def read(self) -> dict[tuple[int, str], list[TokenLogprob]]:
        """Wait for the copy; (seq_id, "output" | "prompt") -> one TokenLogprob per row."""
        values, ids = self.readback.tolist(), 2 + self.plan.num_top  # where the top ids start
        out = {}
        for key, (start, stop, n) in self.plan.spans.items():
            out[key] = [TokenLogprob(int(row[0]), row[1], tuple(map(int, row[ids: ids + n])),
                                     tuple(row[2: 2 + n])) for row in values[start:stop]]
        return out


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, plan: LogprobRows) -> StepLogprobs:
    """Queue the log-probabilities of `plan`'s rows of logits [R, V] (any float dtype), whose tokens
    are the step's choices `targets` [R] int64 where the plan says STEP_TOKEN; start their copy."""
    vocab = logits.shape[-1]
    if vocab > MAX_EXACT_TOKEN_ID:
        raise ValueError(f"a vocabulary of {vocab} tokens has ids float32 cannot carry exactly")
    index, fixed = to_device([plan.rows, plan.tokens], torch.int64, logits.device)
    tokens = torch.where(fixed == STEP_TOKEN, targets[index], fixed)
    num_top = min(plan.num_top, vocab)
    out = torch.empty(len(plan.rows), 2 + 2 * num_top, dtype=torch.float32, device=logits.device)
    out[:, 0] = tokens
    for start, stop, params in plan.groups:
        for first in range(start, stop, MAX_ROWS_PER_PASS):
            last = min(first + MAX_ROWS_PER_PASS, stop)
            x = logits[index[first:last]]
            lp = x.float().log_softmax(dim=-1) if params is None else filtered_logprobs(x, params)
            out[first:last, 1] = lp.gather(1, tokens[first:last, None]).squeeze(1)
            if num_top:
                top = lp.topk(num_top, dim=-1)
                out[first:last, 2:2 + num_top] = top.values
                out[first:last, 2 + num_top:] = top.indices.float()
    return StepLogprobs(plan, HostReadback(out))
