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

FP32_MAX = torch.finfo(torch.float32).max


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (nucleus) filtering.

    Safe for any logits and any temperature (0, subnormal, 1e30, ...) and top_p (down to 5e-324):
    every row keeps its most likely token with weight exactly 1 before normalising, so each row is
    finite, non-negative and sums to 1, and `torch.multinomial` never meets an empty row (on a GPU
    that would be a device-side assert, fatal to every request, which no `try` can catch).

    Parameters
    ----------
    logits : torch.Tensor
        [N, V], any float dtype; NaN counts as -inf and +inf as the largest fp32 value.
    params : SamplingParams
        temperature (0 or below fp32's range: one-hot on the top token, ties shared), top_k (-1 or
        >= V: off), top_p (1.0: off).

    Returns
    -------
    torch.Tensor
        [N, V] float32.
    """
    weights = _log_weights(logits, params).exp()  # exp(-inf) = 0: the filtered tokens weigh nothing
    return weights / weights.sum(dim=-1, keepdim=True)


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The log of `filter_logits`' distribution [N, V] float32 (-inf: filtered out), from the same
    weights, in log space: log_softmax of the temperature-scaled logits over the tokens top-k and
    top-p keep. Greedy: 0 at the top token (log 1/k at a k-way tie), -inf elsewhere."""
    scores = _log_weights(logits, params)
    return scores - scores.logsumexp(dim=-1, keepdim=True)


def _log_weights(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log of the unnormalised sampling weights [N, V] float32: (x - top) / T over the tokens
    top-k and top-p keep (exactly 0 at the top token), -inf elsewhere."""
    x = logits.float().nan_to_num(nan=float("-inf"), posinf=FP32_MAX, neginf=float("-inf"))
    if 0 < params.top_k < x.shape[-1]:  # on the logits: a temperature never reorders them
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    top = x.max(dim=-1, keepdim=True).values
    temperature = min(params.temperature, FP32_MAX)  # as fp32, 1e300 would be inf and -inf / inf NaN
    # (x - top) / T <= 0, exactly 0 at the top: exp cannot overflow, and the top token weighs 1
    scores = torch.where(x >= top, 0.0, (x - top) / temperature)
    if params.top_p < 1.0:
        scores = scores.masked_fill(~_nucleus(scores.exp(), x, params.top_p), float("-inf"))
    return scores


def _nucleus(weights: torch.Tensor, x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens top-p keeps [N, V] (bool): in order of x, the smallest prefix whose mass reaches
    top_p, never fewer than one. The mass runs in float64, so a top_p below fp32's range (1e-46,
    5e-324) is compared as given rather than as 0."""
    order = x.argsort(dim=-1, descending=True, stable=True)
    sorted_weights = weights.gather(-1, order).double()
    mass = sorted_weights.cumsum(dim=-1)
    before = (mass - sorted_weights) / mass[..., -1:]  # the mass of the tokens ranked above each
    keep = before < top_p
    keep[..., 0] = True  # the most likely token, whatever rounding says
    return torch.zeros_like(keep).scatter(-1, order, keep)


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
