"""The fused small ops (Triton, interpreter on CPU) against the torch references of kernels.layers."""

import pytest
import torch
import torch.nn.functional as F

from kernels.fused_layers import norm_rope, rms_norm, silu_and_mul
from kernels.layers import RotaryEmbedding, apply_rope
from kernels.layers import rms_norm as reference_rms_norm

TOL = dict(rtol=1e-5, atol=1e-6)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


@pytest.mark.parametrize("cols", [16, 48, 100])
def test_rms_norm_matches_the_reference_on_strided_rows(cols):
    wide = torch.randn(5, 3, cols + 7, device=DEVICE)
    x = wide[..., :cols]  # rows of stride cols + 7, as a view of a wider projection would give
    weight = torch.randn(cols, device=DEVICE)
    expected = reference_rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6, backend="triton"), expected, **TOL)


def test_rms_norm_after_the_residual_add_returns_both():
    x, residual, weight = (torch.randn(shape, device=DEVICE) for shape in ((7, 40), (7, 40), (40,)))
    out, total = rms_norm(x, weight, 1e-5, residual=residual, backend="triton")
    torch.testing.assert_close(total, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(out, reference_rms_norm(x + residual, weight, 1e-5), **TOL)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("head_dim,heads", [(16, 3), (32, 11), (64, 3), (16, 1)])  # 11: a partial head block
def test_norm_rope_matches_norm_then_rope(with_norm, head_dim, heads):
    tokens = 6
    qkv = torch.randn(tokens, (heads + 2) * head_dim, device=DEVICE)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)  # strided, like the fused projection's
    weight = torch.randn(head_dim, device=DEVICE) if with_norm else None
    cos, sin = RotaryEmbedding(head_dim, 10000.0).cos_sin(torch.tensor([0, 3, 17, 4095, 2, 9], device=DEVICE))
    expected = apply_rope(reference_rms_norm(q, weight, 1e-6) if with_norm else q, cos, sin)
    torch.testing.assert_close(norm_rope(q, weight, cos, sin, 1e-6, backend="triton"), expected, **TOL)


@pytest.mark.parametrize("inter", [16, 48, 1500])  # 1500: more than one column block
def test_silu_and_mul_matches_silu_times_up(inter):
    x = torch.randn(2, 3, 2 * inter, device=DEVICE) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x, backend="triton"), F.silu(gate) * up, **TOL)


def test_auto_runs_the_reference_on_cpu_and_bad_shapes_are_named():
    x, weight = torch.randn(4, 16), torch.randn(16)
    assert torch.equal(rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6))
    with pytest.raises(ValueError, match=r"weight must be \[16\], got \(8,\)"):
        rms_norm(x, torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        rms_norm(x, weight, 1e-6, residual=torch.randn(4, 8))
    with pytest.raises(ValueError, match="must be even, got 15"):
        silu_and_mul(torch.randn(2, 15))
    with pytest.raises(ValueError, match=r"cos and sin must be \[4, 16\]"):
        norm_rope(torch.randn(4, 2, 16), None, torch.randn(3, 16), torch.randn(3, 16), 1e-6)


@pytest.mark.gpu
def test_bf16_rounds_where_the_references_round():
    """bf16 on the GPU: every value the reference rounds is rounded at the same point, so the fused
    results differ from the chains of torch kernels by at most the order of one fp32 sum (one ulp)."""
    shapes = ((33, 4096), (33, 4096), (4096,))
    x, residual, weight = (torch.randn(shape, device="cuda").bfloat16() for shape in shapes)
    out, total = rms_norm(x, weight, 1e-6, residual=residual)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(out, reference_rms_norm(x + residual, weight, 1e-6), rtol=8e-3, atol=0)
    q = torch.randn(33, 32, 128, device="cuda").bfloat16()
    cos, sin = RotaryEmbedding(128, 1e6).cos_sin(torch.arange(33, device="cuda") * 97)
    w = torch.randn(128, device="cuda").bfloat16()
    expected = apply_rope(reference_rms_norm(q, w, 1e-6), cos, sin)
    torch.testing.assert_close(norm_rope(q, w, cos, sin, 1e-6), expected, rtol=8e-3, atol=8e-3)
    gu = torch.randn(33, 2 * 12288, device="cuda").bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gu), F.silu(gate) * up, rtol=8e-3, atol=0)
