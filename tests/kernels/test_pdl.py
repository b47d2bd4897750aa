"""kernels.pdl: when launches use programmatic dependent launch, and that it changes no result."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import pdl


def test_never_on_cpu_tensors_the_interpreter_runs():
    assert not pdl.use_pdl(torch.device("cpu"))


@pytest.mark.gpu
def test_switch_turns_it_off_on_a_gpu(monkeypatch):
    device = torch.device("cuda")
    expected = torch.cuda.get_device_capability()[0] >= 9 and pdl.HAS_GDC
    assert pdl.use_pdl(device) == expected
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.use_pdl(device)


@pytest.mark.gpu
def test_results_are_bitwise_equal_with_and_without_it(monkeypatch):
    # a split context call (split + merge kernels) and a split decode (fused merge), back to back
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    pages = torch.randperm(256, device="cuda", generator=gen).int().view(2, 128)
    k_cache = torch.randn(256, 16, 4, 128, generator=gen, **dev)
    v_cache = torch.randn(256, 16, 4, 128, generator=gen, **dev)
    q_ctx = torch.randn(2, 16, 16, 128, generator=gen, **dev)
    noise = [torch.randn(2, 16, 4, 128, generator=gen, **dev) for _ in range(2)]
    ctx_lens = torch.tensor([2000, 1500], dtype=torch.int32, device="cuda")
    q_dec = torch.randn(2, 16, 128, generator=gen, **dev)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")

    def both():
        ctx = kernels.paged_context_attention(q_ctx, k_cache, v_cache, pages, ctx_lens, *noise)
        dec = kernels.paged_attention(q_dec, k_cache, v_cache, pages, ctx_lens, starts)
        return ctx, dec

    with_pdl = both()
    monkeypatch.setattr(pdl, "ENABLED", False)
    without = both()
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)
