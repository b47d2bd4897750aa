"""Token choice (over logits tensors) and the speculative accept rule (stated over plain ints).

The accept rule: sample (or argmax) the TARGET's token at every verified position, then accept
the longest prefix of drafts that equals those samples, plus the target's token at the first
mismatch (or after the last draft). With one-hot draft distributions this is exactly speculative
sampling: a draft d is accepted with probability p(d), and on mismatch the emitted target sample is
distributed as p restricted to tokens != d, renormalised, which is the residual max(p - q, 0).
Greedy (temperature 0) is the same rule with argmax, so it equals target-only greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from target_service.engine.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [N, V] after temperature, top-k and top-p (nucleus) filtering, in fp32."""
    scaled = logits.float() / params.temperature
    if params.top_k != -1 and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it does
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def choose_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of logits [N, V] for one request: argmax when greedy, else a sample."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def accept_drafts(drafts: Sequence[int], target_tokens: Sequence[int]) -> tuple[int, list[int]]:
    """Accepted draft count and the emitted tokens of one request, over plain ints: the rule as
    stated, which the engine runs for the whole batch on the device (`verify.accepted_lengths`,
    tested against this).

    drafts: K proposed tokens d_1..d_K; target_tokens: K+1, the target's choice after the bonus and
    after each draft. Accept the longest prefix with d_i == target_tokens[i-1], then one target
    token: emitted = target_tokens[0..accepted].
    """
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, list(target_tokens[: accepted + 1])
