"""The draft budget: how many drafts a decoding sequence verifies and how many of them may count.

One rule, stated once, in two forms: `max_accepted` over a sequence's plain ints (the scheduler) and
`max_accepted_on_device` over tensors of a whole batch (a step launched ahead, whose inputs exist only
on the device). A test holds the two equal on random states.

A sequence with n computed positions verifies rows n..n+k (the bonus and k drafts); accepting a of
them emits a + 1 tokens, so it ends with n + a + 2 tokens. Both limits follow:
- max_model_len: n + a + 2 <= max_model_len;
- max_tokens: a + 1 <= the request's remaining output tokens.

Every drafting sequence still verifies all of the step's drafts (K, or the step's adaptive k) when
its rows fit max_model_len (`verifies_full_block`), whatever fewer may count: steps stay uniform (one
CUDA graph), and the rows past the count are ignored (causal attention keeps them out of the rows
that count). A request's own limit (`SamplingParams.num_speculative_tokens`) lowers only the count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftBudget:
    num_speculative_tokens: int  # K
    max_model_len: int

    def max_accepted(self, num_computed: int, num_remaining: int) -> int:
        """Drafts that may count for a sequence at `num_computed` with `num_remaining` output tokens
        left to its max_tokens."""
        k = self.num_speculative_tokens
        return max(0, min(k, self.max_model_len - num_computed - 2, num_remaining - 1))

    def max_accepted_on_device(self, num_computed: torch.Tensor, num_remaining: torch.Tensor) -> torch.Tensor:
        """`max_accepted` of every sequence of a batch: int tensors [B] in, [B] out."""
        limit = torch.minimum(self.max_model_len - num_computed - 2, num_remaining - 1)
        return limit.clamp(min=0, max=self.num_speculative_tokens)

    def verifies_full_block(self, num_computed: int, num_verified: int | None = None) -> bool:
        """Whether `num_verified` drafts (default K; num_verified + 1 rows, and the token after them)
        fit max_model_len."""
        k = self.num_speculative_tokens if num_verified is None else num_verified
        return num_computed + k + 2 <= self.max_model_len
