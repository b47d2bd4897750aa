"""kernels.pdl: when launches use programmatic dependent launch, and that it changes no result."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import pdl


def test_never_on_cpu_tensors_the_interpreter_runs():
    assert not pdl.use_pdl(torch.device("cpu"))


@pytest.mark.parametrize(("sm90", "has_gdc"), [(True, True), (False, True), (True, False)])
def test_only_sm90_gpus_under_a_triton_with_grid_dependency_control(sm90, has_gdc, monkeypatch):
    # the capability query stands in for the GPU: an explicit index never asks torch.cuda for one
    monkeypatch.setattr(pdl, "_device_supports_pdl", lambda index: sm90)
    monkeypatch.setattr(pdl, "HAS_GDC", has_gdc)
    assert pdl.use_pdl(torch.device("cuda", 0)) == (sm90 and has_gdc)


@pytest.mark.gpu
def test_this_gpu_uses_it_when_it_is_sm90_or_later():
    expected = torch.cuda.get_device_capability()[0] >= 9 and pdl.HAS_GDC
    assert pdl.use_pdl(torch.device("cuda")) == expected


@pytest.mark.gpu
def test_results_are_bitwise_equal_with_and_without_it(monkeypatch):
    # a split context call (split + merge kernels) and a split decode (fused merge), back to back;
    # "without" is the launches a GPU before sm_90 takes, here on this one
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
    monkeypatch.setattr(pdl, "_device_supports_pdl", lambda index: False)
    without = both()
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_a_layers_small_kernels_chained_are_bitwise_equal_with_and_without_it(rows, monkeypatch):
    # a layer's chain with each kernel reading the one before's output: residual add + RMSNorm, q/k
    # norm + RoPE + K/V store into pages, per-head norm + RoPE, SiLU-and-mul (random values, fresh each run)
    from kernels.fused_layers import norm_rope, rms_norm, silu_and_mul
    from kernels.qkv_epilogue import norm_rope_store

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    heads, kv_heads, dim, hidden = 8, 2, 128, 1024
    x, residual = (torch.randn(rows, hidden, generator=gen, **dev) for _ in range(2))
    weight, q_norm, k_norm = (torch.rand(n, generator=gen, **dev) + 0.5 for n in (hidden, dim, dim))
    angles = torch.rand(rows, dim // 2, generator=gen, device="cuda") * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.randperm(512, generator=gen, device="cuda")[:rows]

    def chain():
        normed, total = rms_norm(x, weight, 1e-6, residual=residual, backend="triton")
        width = heads + 2 * kv_heads
        qkv = normed[:, : width * dim // 2].repeat(1, 2).view(rows, width, dim)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        k_cache, v_cache = (torch.zeros(32, 16, kv_heads, dim, **dev) for _ in range(2))
        q_out = norm_rope_store(q, k, v, q_norm, k_norm, cos, sin, 1e-6, k_cache, v_cache, slots,
                                backend="triton")
        rotated = norm_rope(q_out, q_norm, cos, sin, 1e-6, backend="triton")
        return total, q_out, k_cache, v_cache, rotated, silu_and_mul(normed, backend="triton")

    with_pdl = chain()
    monkeypatch.setattr(pdl, "_device_supports_pdl", lambda index: False)
    without = chain()
    for a, b in zip(with_pdl, without):
        assert torch.equal(a, b)
