"""The q/k/v projection's epilogue in one launch: q and k normed per head and rotated, k and v stored.

A layer's attention input used to take three kernels after its q/k/v GEMM: `norm_rope` for q,
`norm_rope` for k, then `store_kv`. At batch 1 each is a few microseconds of launch and drain
for a few kilobytes of data, 108 of them per step of a 36-layer target. `norm_rope_store` does
the three in one launch: programs of the grid's second axis take either HEADS query heads
(normed, rotated, written to the returned q) or HEADS key/value heads of one token (k normed and
rotated, then k and v written at the token's slot, quantised for an fp8 cache). The rotated k
never leaves the kernel: attention reads it from the pages.

The math and roundings are `norm_rope` then `store_kv`'s (`kernels.fused_layers`,
`kernels.store`): every value those round to the activation dtype is rounded here at the same
point, and an fp8 cache gets clamp(value / scale) of the rounded value. Backend "auto" runs that
composition itself on CPU tensors (`kernels.dispatch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.dispatch import resolve_backend
from kernels.fused_layers import NORM_ROPE_HEADS, normed_rope_halves
from kernels.fused_layers import norm_rope as norm_rope_op
from kernels.operands import TL_DTYPES
from kernels.store import cache_values, check_store_inputs
from kernels.store import store_kv as store_kv_op
from kernels.validation import FP8, check_rank, scale_argument


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # a view at any offset of a step's slots
def _norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr, k_scale, v_scale, num_q_heads, num_kv_heads, half, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_ot, stride_oh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    Q_PROGRAMS: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr, QUANTIZE: tl.constexpr, DTYPE: tl.constexpr, USE_PDL: tl.constexpr,
):
    # program (token, j): j < Q_PROGRAMS takes query heads j * HEADS.., the rest key/value heads
    token = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    col_mask = i < half
    pdl.wait_for_previous_grid(USE_PDL)  # the projection's q, k, v (and the step's slots, cos, sin)
    pdl.allow_next_grid(USE_PDL)  # the attention after it waits for this grid's stores all the same
    if j < Q_PROGRAMS:
        heads = j * HEADS + tl.arange(0, HEADS)
        mask = (heads < num_q_heads)[:, None] & col_mask[None, :]
        src = q_ptr + token * stride_qt + heads[:, None] * stride_qh + i[None, :]
        y1, y2 = normed_rope_halves(src, q_norm_ptr, cos_ptr, sin_ptr, token, stride_ct, i, mask, col_mask,
                                    half, eps, HAS_Q_NORM, DTYPE)
        dst = q_out_ptr + token * stride_ot + heads[:, None] * stride_oh + i[None, :]
        tl.store(dst, y1.to(DTYPE), mask=mask)
        tl.store(dst + half, y2.to(DTYPE), mask=mask)
    else:
        heads = (j - Q_PROGRAMS) * HEADS + tl.arange(0, HEADS)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        # a negative slot (PAD_SLOT) stores nothing; compared per head so the mask is a tensor
        keep = (heads < num_kv_heads) & ((tl.zeros([HEADS], dtype=tl.int64) + slot) >= 0)
        mask = keep[:, None] & col_mask[None, :]
        src = k_ptr + token * stride_kt + heads[:, None] * stride_kh + i[None, :]
        k1, k2 = normed_rope_halves(src, k_norm_ptr, cos_ptr, sin_ptr, token, stride_ct, i, mask, col_mask,
                                    half, eps, HAS_K_NORM, DTYPE)
        v_src = v_ptr + token * stride_vt + heads[:, None] * stride_vh + i[None, :]
        v1 = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + half, mask=mask, other=0.0).to(tl.float32)
        safe = tl.maximum(slot, 0)
        block, offset = safe // TOKENS_PER_BLOCK, safe % TOKENS_PER_BLOCK
        k_dst = (k_cache_ptr + block * stride_kcb + offset * stride_kct + heads[:, None] * stride_kch
                 + i[None, :])
        v_dst = (v_cache_ptr + block * stride_vcb + offset * stride_vct + heads[:, None] * stride_vch
                 + i[None, :])
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_dst, cache_values(k1, k_scale, K_SCALE_MODE, QUANTIZE).to(cache_dtype), mask=mask)
        tl.store(k_dst + half, cache_values(k2, k_scale, K_SCALE_MODE, QUANTIZE).to(cache_dtype), mask=mask)
        tl.store(v_dst, cache_values(v1, v_scale, V_SCALE_MODE, QUANTIZE).to(cache_dtype), mask=mask)
        tl.store(v_dst + half, cache_values(v2, v_scale, V_SCALE_MODE, QUANTIZE).to(cache_dtype), mask=mask)


def _launch_norm_rope_store(q, k, v, q_norm, k_norm, cos, sin, eps, k_cache, v_cache, slot_mapping,
                            k_scale, v_scale) -> torch.Tensor | None:
    tokens, num_kv_heads, head_dim = k.shape
    num_q_heads = q.shape[1] if q is not None else 0
    quantize = k_cache.dtype == FP8
    if not quantize:  # scales only quantise (as in store_kv)
        k_scale = v_scale = None
    half = head_dim // 2
    heads = min(NORM_ROPE_HEADS, triton.next_power_of_2(max(num_q_heads, num_kv_heads)))
    q_programs = triton.cdiv(num_q_heads, heads)
    q_out = None
    if q is not None:
        q_out = torch.empty((tokens, num_q_heads, head_dim), dtype=k.dtype, device=k.device)
    q_arg, out_arg = (q, q_out) if q is not None else (k, k)  # never read: no query programs
    k_arg, k_mode = scale_argument(k_scale)
    v_arg, v_mode = scale_argument(v_scale)
    cos, sin = cos.contiguous(), sin.contiguous()
    use_pdl = pdl.use_pdl(k.device)
    _norm_rope_store_kernel[(tokens, q_programs + triton.cdiv(num_kv_heads, heads))](
        q_arg, k, v, q_norm if q_norm is not None else k, k_norm if k_norm is not None else k, cos, sin,
        out_arg, k_cache, v_cache, slot_mapping, k_arg, v_arg, num_q_heads, num_kv_heads, half, eps,
        q_arg.stride(0), q_arg.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        out_arg.stride(0), out_arg.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        Q_PROGRAMS=q_programs, HEADS=heads, BLOCK=triton.next_power_of_2(half),
        TOKENS_PER_BLOCK=k_cache.shape[1],
        HAS_Q_NORM=q_norm is not None, HAS_K_NORM=k_norm is not None, K_SCALE_MODE=k_mode,
        V_SCALE_MODE=v_mode, QUANTIZE=quantize, DTYPE=TL_DTYPES[k.dtype], USE_PDL=use_pdl,
        launch_pdl=use_pdl,
    )
    return q_out


def _check(q, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    check_store_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    tokens, _, head_dim = k.shape
    if q is not None:
        check_rank(q, 3, "q", "[T, NH, D]")
        if q.shape[0] != tokens or q.shape[2] != head_dim or q.dtype != k.dtype:
            raise ValueError(f"q must be [{tokens}, NH, {head_dim}] in k's dtype {k.dtype}, got "
                             f"{tuple(q.shape)} {q.dtype}")
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None and tuple(weight.shape) != (head_dim,):
            raise ValueError(f"{name} must be [{head_dim}], got {tuple(weight.shape)}")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise ValueError(f"cos and sin must be fp32 [{tokens}, {head_dim}], got {tuple(cos.shape)} "
                         f"{cos.dtype}, {tuple(sin.shape)}")
    strided = [t for t in (q, k, v) if t is not None and t.stride(-1) != 1]
    if strided or head_dim % 2 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("norm_rope_store needs a unit stride on D (q, k, v and both caches) and an even D")


def norm_rope_store(q, k, v, q_norm, k_norm, cos, sin, eps: float, k_cache, v_cache, slot_mapping, *,
                    k_scale=None, v_scale=None, backend: str = "auto") -> torch.Tensor | None:
    """Per-head RMSNorm (where a norm weight is given) and RoPE of q and k; k and v stored in the pages.

    Parameters
    ----------
    q : Tensor [T, NH, D] or None
        Query heads, unit stride on D (views of a fused q/k/v projection are fine); None stores only.
    k, v : Tensor [T, NKV, D], the activation dtype (q's), unit stride on D
    q_norm, k_norm : Tensor [D] or None
        Qwen3's per-head norms; None (Llama) rotates without one.
    cos, sin : Tensor [T, D] fp32, the half-frequencies repeated twice (`RotaryEmbedding.cos_sin`)
    k_cache, v_cache, slot_mapping, k_scale, v_scale
        As `kernels.store_kv`: row t of k and v goes to slot_mapping[t]; PAD_SLOT (-1) skips it.
    backend : "auto" | "triton" | "torch"
        See `kernels.dispatch`.

    Returns
    -------
    Tensor [T, NH, D], contiguous, q normed and rotated; None when q is None.
    """
    _check(q, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if resolve_backend(backend, k.device) == "torch":  # the reference composition
        q_out = norm_rope_op(q, q_norm, cos, sin, eps, backend="torch") if q is not None else None
        k_out = norm_rope_op(k, k_norm, cos, sin, eps, backend="torch")
        store_kv_op(k_out, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                    backend="torch")
        return q_out
    if k.shape[0] == 0:
        return torch.empty_like(q) if q is not None else None
    return _launch_norm_rope_store(q, k, v, q_norm, k_norm, cos, sin, eps, k_cache, v_cache, slot_mapping,
                                   k_scale, v_scale)
