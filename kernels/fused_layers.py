"""The step's small ops fused into one kernel each: RMSNorm (optionally after the residual add),
per-head RMSNorm + RoPE for q and k, and SiLU-and-mul.

In torch each is a chain of elementwise kernels (RMSNorm alone is six: pow, mean, add, rsqrt, mul,
mul), so a Qwen3 layer spent ~50 launches on them; here it is five. The math and the roundings are
the torch references' (`kernels.layers`: `rms_norm`, `apply_rope`, `swiglu`'s activation): statistics
and rotations in fp32, every value the reference rounds to the model dtype rounded here at the same
point, so a bf16 model sees the same numbers up to the order of one fp32 sum. Backend "auto" runs
the reference on CPU tensors (`kernels.dispatch`). On Hopper each is launched with programmatic
dependent launch (`kernels.pdl`), as the GEMMs and attention around them are: at batch 1 these
kernels take 2-3 us each, so the launch gap before each is a good part of their time (on an H100
the batch-1 step took 0.984 of its time without it: bench/results/pdl_small_kernels_h100.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels.dispatch import resolve_backend
from kernels.layers import apply_rope
from kernels.layers import rms_norm as rms_norm_reference
from kernels.operands import TL_DTYPES

SILU_BLOCK = 1024
# Heads one norm_rope program takes: one head per program left a 512-row verify (B 32) at ~12 us per
# layer for q, 16k programs of 64 elements each; a [heads, D/2] tile cuts the programs 8x.
NORM_ROPE_HEADS = 8


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, n_cols, stride_x, stride_r,
                     stride_o, stride_s, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     DTYPE: tl.constexpr, USE_PDL: tl.constexpr):
    # one row: [sum = x + residual, rounded to DTYPE], out = weight * (s * rsqrt(mean(s^2) + eps))
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    pdl.wait_for_previous_grid(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(DTYPE)
        tl.store(sum_ptr + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl.allow_next_grid(USE_PDL)
    y = (x * inv).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(DTYPE), mask=mask)


@triton.jit
def normed_rope_halves(src, weight_ptr, cos_ptr, sin_ptr, token, stride_ct, i, mask, col_mask, half, eps,
                       HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):
    """The two rotated halves [HEADS, BLOCK] of the heads at `src` (pointers to their first halves):
    per-head RMSNorm when HAS_NORM (rounded like the reference), then the NeoX rotation, fp32 values
    of DTYPE-rounded results. Shared by `norm_rope` and `kernels.qkv_epilogue`."""
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half) + eps)
        w1 = tl.load(weight_ptr + i, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + i, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * inv[:, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        x2 = (w2 * (x2 * inv[:, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    c = tl.load(cos_ptr + token * stride_ct + i, mask=col_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + token * stride_ct + i, mask=col_mask, other=0.0)[None, :]
    y1 = (x1 * c - x2 * s).to(DTYPE).to(tl.float32)
    y2 = (x2 * c + x1 * s).to(DTYPE).to(tl.float32)
    return y1, y2


@triton.jit
def _norm_rope_kernel(x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, half, stride_xt, stride_xh,
                      stride_ct, stride_ot, stride_oh, eps, HAS_NORM: tl.constexpr, HEADS: tl.constexpr,
                      BLOCK: tl.constexpr, DTYPE: tl.constexpr, USE_PDL: tl.constexpr):
    # HEADS heads of one token: [per-head RMSNorm, rounded like the reference], then the NeoX rotation
    token = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    i = tl.arange(0, BLOCK)
    col_mask = i < half
    mask = (heads < num_heads)[:, None] & col_mask[None, :]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + i[None, :]
    pdl.wait_for_previous_grid(USE_PDL)
    y1, y2 = normed_rope_halves(src, weight_ptr, cos_ptr, sin_ptr, token, stride_ct, i, mask, col_mask, half,
                                eps, HAS_NORM, DTYPE)
    pdl.allow_next_grid(USE_PDL)
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + i[None, :]
    tl.store(dst, y1.to(DTYPE), mask=mask)
    tl.store(dst + half, y2.to(DTYPE), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
                         USE_PDL: tl.constexpr):
    # out[:, j] = silu(gate[:, j]) * up[:, j] with x = [gate | up]; silu rounded first, as torch does
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    pdl.wait_for_previous_grid(USE_PDL)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    pdl.allow_next_grid(USE_PDL)
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(DTYPE), mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as 2-d rows with a unit last stride (a view when it can be)."""
    if x.dtype not in TL_DTYPES:
        raise ValueError(f"{name} must be fp32 / fp16 / bf16, got {x.dtype}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             backend: str = "auto"):
    """RMSNorm of the last dim; with `residual`, of (x + residual) rounded to x's dtype.

    Parameters
    ----------
    x : Tensor [..., N], fp32 / fp16 / bf16
    weight : Tensor [N]
    residual : Tensor like x, optional

    Returns
    -------
    out, like x; with `residual`, the pair (out, x + residual).
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if resolve_backend(backend, x.device) == "torch":
        if residual is None:
            return rms_norm_reference(x, weight, eps)
        total = x + residual
        return rms_norm_reference(total, weight, eps), total
    rows = _rows(x, "x")
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res = _rows(residual, "residual") if residual is not None else rows
    total = torch.empty_like(out) if residual is not None else out
    n = rows.shape[1]
    use_pdl = pdl.use_pdl(x.device)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res, weight, out, total, n, rows.stride(0), res.stride(0), out.stride(0), total.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n), DTYPE=TL_DTYPES[x.dtype],
        USE_PDL=use_pdl, launch_pdl=use_pdl)
    out = out.view(x.shape)
    return out if residual is None else (out, total.view(x.shape))


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
              *, backend: str = "auto") -> torch.Tensor:
    """Per-head RMSNorm (when `weight` is given: Qwen3's q_norm / k_norm) and then RoPE.

    Parameters
    ----------
    x : Tensor [T, H, D], unit stride on D (views of a fused qkv projection are fine)
    weight : Tensor [D] or None
    cos, sin : Tensor [T, D] fp32, the half-frequencies repeated twice (`RotaryEmbedding.cos_sin`)

    Returns
    -------
    Tensor [T, H, D] in x's dtype, contiguous.
    """
    tokens, heads, head_dim = x.shape
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{tokens}, {head_dim}], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if resolve_backend(backend, x.device) == "torch":
        normed = rms_norm_reference(x, weight, eps) if weight is not None else x
        return apply_rope(normed, cos, sin)
    if x.stride(-1) != 1 or head_dim % 2 or cos.dtype != torch.float32:
        raise ValueError("norm_rope needs a unit stride on D, an even D and fp32 cos / sin")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    half = head_dim // 2
    heads_per_program = min(NORM_ROPE_HEADS, triton.next_power_of_2(heads))
    use_pdl = pdl.use_pdl(x.device)
    _norm_rope_kernel[(tokens, triton.cdiv(heads, heads_per_program))](
        x, weight if weight is not None else x, cos, sin, out, heads, half, x.stride(0), x.stride(1),
        cos.stride(0), out.stride(0), out.stride(1), eps, HAS_NORM=weight is not None,
        HEADS=heads_per_program, BLOCK=triton.next_power_of_2(half), DTYPE=TL_DTYPES[x.dtype],
        USE_PDL=use_pdl, launch_pdl=use_pdl)
    return out


def silu_and_mul(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up of x = [gate | up] along the last dim: [..., 2I] -> [..., I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim of x holds gate and up, so it must be even, got {x.shape[-1]}")
    if resolve_backend(backend, x.device) == "torch":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows = _rows(x, "x")
    inter = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    use_pdl = pdl.use_pdl(x.device)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, inter, rows.stride(0), out.stride(0), BLOCK=block, DTYPE=TL_DTYPES[x.dtype],
        USE_PDL=use_pdl, launch_pdl=use_pdl)
    return out.view(*x.shape[:-1], inter)
