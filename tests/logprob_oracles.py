"""Oracles for log-probabilities, written apart from the engine: the sampler's processed distribution
by sorting, and the target's raw log-probabilities from HF transformers over the same checkpoint."""

from __future__ import annotations

import math

import torch

from target_service.engine.sampling_params import SamplingParams


def processed_oracle(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log of the sampling distribution [N, V] float64, by hand, row by row: keep the top_k largest
    logits, scale by the temperature, keep the smallest most likely prefix whose mass reaches top_p,
    renormalise; -inf for every token dropped."""
    out = torch.full(logits.shape, -math.inf, dtype=torch.float64)
    for r, row in enumerate(logits.double()):
        order = row.argsort(descending=True)
        kept = order[: params.top_k] if params.top_k > 0 else order
        probs = torch.softmax(row[kept] / params.temperature, dim=0)
        mass, count = 0.0, 0
        for p in probs.tolist():
            if mass >= params.top_p:
                break
            mass, count = mass + p, count + 1
        chosen = kept[:count]
        out[r, chosen] = torch.log_softmax(row[chosen] / params.temperature, dim=0)
    return out


class HFTarget:
    """The target checkpoint in HF transformers, float32: logits and log_softmax of a token sequence."""

    def __init__(self, target_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len, V] float32: row i is the distribution of the token after token_ids[: i + 1]."""
        with torch.no_grad():
            return self.model(torch.tensor([token_ids])).logits[0].float()

    def log_softmax(self, token_ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.logits(token_ids), dim=-1)


def assert_entry_matches(entry, row: torch.Tensor, token: int, num_top: int, atol: float = 1e-4) -> None:
    """One TokenLogprob against its row of log-probabilities [V]: the token, its value, the top N
    values (most likely first), and each top token's own value."""
    assert entry.token_id == token
    assert abs(entry.logprob - float(row[token])) <= atol, (entry.logprob, float(row[token]))
    top = row.topk(num_top)
    assert len(entry.top_token_ids) == len(entry.top_logprobs) == num_top
    assert all(abs(a - b) <= atol for a, b in zip(entry.top_logprobs, top.values.tolist())), (
        entry.top_logprobs, top.values.tolist())
    own = zip(entry.top_token_ids, entry.top_logprobs)
    assert all(abs(value - float(row[i])) <= atol for i, value in own)
