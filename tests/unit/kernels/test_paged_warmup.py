"""The paged attention warm-up finds every launch variant a step can reach: against planning every
(T, B) pair one by one, with the GPU's rules (an H200's SM count, or a small one so the split plan
saturates early), for random head geometries and both cache dtypes."""

import random

import pytest
import torch

from kernels import paged_warmup, split_kv
from kernels.paged_attention import plan_launch


@pytest.mark.parametrize("sms", [132, 6])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_variants_found_are_those_of_every_shape(monkeypatch, sms, cache_dtype):
    monkeypatch.setattr(split_kv, "num_sms", lambda device: sms)
    rng = random.Random(int(torch.randint(0, 2**31, ()).item()))
    num_kv_heads = rng.choice([1, 2, 8])
    num_heads = num_kv_heads * rng.choice([1, 4, 8])
    head_dim = rng.choice([64, 128])
    max_tokens, max_seqs = rng.randint(200, 420), rng.randint(8, 40)
    device = torch.device("cuda")  # planning only: nothing is launched
    plan = lambda tokens, seqs: plan_launch(tokens, seqs, num_heads, num_kv_heads, head_dim, device,
                                            cache_dtype, torch.bfloat16)
    every = {plan(tokens, seqs).variant
             for seqs in range(1, max_seqs + 1) for tokens in range(seqs, max_tokens + 1)}
    found = paged_warmup.reachable_variants(max_tokens, max_seqs, num_heads, num_kv_heads, head_dim, device,
                                            cache_dtype, torch.bfloat16)
    assert len(every) >= 3 and set(found) == every  # decode, verify and prefill at least
    for variant, (tokens, seqs) in found.items():
        assert seqs <= tokens <= max_tokens and seqs <= max_seqs
        assert plan(tokens, seqs).variant == variant
