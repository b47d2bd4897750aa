"""`Sequence`: the one object that carries a request's state through the engine.

Positions and phases. Let n = `num_computed` (positions whose target K/V and draft context are
written) and `token_ids` = prompt + output. Decoding, the newest token (the "bonus") sits at
position n = len(token_ids) - 1 and the target has not run on it yet. Before that the sequence is
prefilling: its first `prefill_len` tokens go through the target in chunks. A new request prefills
the whole prompt and samples its first token from the last prompt row; a preempted one (recompute)
prefills everything but its newest token, which becomes the bonus again, with no sampling.

Who writes what:

| field                                   | writer                                            |
| --------------------------------------- | ------------------------------------------------- |
| status, num_context                     | Scheduler                                         |
| seq_index, block_table, num_cached_tokens | Scheduler, from the pool's open / reserve         |
| output_token_ids, num_computed,         | LLMEngine (after each step)                       |
| num_pool_known_tokens, finish_reason,   |                                                   |
| spec_decode (the request's counters),   |                                                   |
| output_logprobs, prompt_logprobs        |                                                   |
| has_context                             | ModelRunner (False when the drafter misses a step) |
| acceptance (its per-position curve)     | LLMEngine, with adaptive speculation              |
| generator                               | LLMEngine (at add_request, from the runner)       |

The runner reads a sequence to build the step's tensors; it writes only `has_context`.

`has_context` turns False when a step ran while the drafter was unavailable (its process died): the
drafter then holds no context for that step's positions, so the sequence decodes plainly (verifies
no drafts) until it is recomputed from its prefix; `num_context` stays where the context ends, so
the pool never caches a block whose draft context was not written.

Log-probabilities, for a request that asks (`SamplingParams.logprobs`, `prompt_logprobs`; None
otherwise): `output_logprobs[i]` is output token i's, `prompt_logprobs[i]` prompt token i's (the first
None: nothing predicts it). Prompt token i's comes from the logits at position i - 1, so a request
whose prompt logprobs are not all in prefills from the first position that still needs logits
(`prefill_start`), even below `num_computed`: those positions are in the pages already (a prefix-cache
hit, or a recompute) and run again for their logits only, storing nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from target_service.engine.acceptance_curve import AcceptanceCurve
from target_service.engine.outputs import SpecDecodeStats, TokenLogprob
from target_service.engine.sampling_params import SamplingParams
from target_service.structured.constraint import TokenConstraint


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    seq_id: int  # the pool's id of this sequence; unique in the engine
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order: the newest running sequence is preempted first
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    seq_index: int = -1  # its row in the pool's per-sequence tables (-1: not open)
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_computed: int = 0
    num_pool_known_tokens: int = 0  # token ids the pool has been told (for prefix hashing)
    finish_reason: str | None = None
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    num_preemptions: int = 0
    has_context: bool = True  # the drafter holds context for every computed position
    num_context: int = 0  # positions whose draft context the pool has been told is stored
    output_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    constraint: TokenConstraint | None = None  # the grammar its output must match (structured outputs)
    acceptance: AcceptanceCurve | None = None  # its drafts' acceptance per position (adaptive speculation)

    def __post_init__(self):
        if self.params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] (0 <= start <= end), at the cost of end - start: `token_ids` joins the
        prompt and the output anew on every read, O(length) a call."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens the target must see before decoding: all but the bonus, once there is one."""
        return self.num_tokens - 1 if self.output_token_ids else self.num_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Output tokens left before max_tokens."""
        return self.params.max_tokens - len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def prefill_start(self) -> int:
        """Where the next prefill chunk starts: num_computed, or the first position whose logits a
        prompt logprob still needs, when that is earlier."""
        positions = self.prompt_logprob_positions(0, self.num_computed)
        return positions.start if positions else self.num_computed

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """The positions in start..end-1 whose logits give a prompt token's logprob not yet known
        (position p gives prompt token p + 1's)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, len(self.prompt_token_ids) - 1))

    @property
    def bonus_token(self) -> int:
        return self.output_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Forget the pool state after preemption; tokens stay and are prefilled again."""
        self.status = SequenceStatus.WAITING
        self.seq_index, self.block_table = -1, []
        self.num_cached_tokens = self.num_computed = self.num_pool_known_tokens = self.num_context = 0
        self.has_context = True  # the prefill stores the context again
        self.num_preemptions += 1
