"""Scatter K/V rows into the pool's pages: row i goes to slot_mapping[i] = block * tpb + offset.

A slot of PAD_SLOT (-1) skips its row, so a fixed-shape store (one CUDA graph for any accepted
count) can mask the rows past what was accepted instead of changing shape. An fp8 cache is
written quantised: stored = clamp(row / scale, +-448) in float8_e4m3fn (round to nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.dispatch import resolve_backend
from kernels.reference.store import PAD_SLOT
from kernels.validation import (
    ACTIVATION_DTYPES,
    FP8,
    check_cache_pair,
    check_index_tensor,
    check_rank,
    check_same_device,
    check_scale,
    scale_argument,
)

FP8_MAX = 448.0  # largest finite float8_e4m3fn

__all__ = ["PAD_SLOT", "store_kv"]


@triton.jit
def cache_values(x, scale, SCALE_MODE: tl.constexpr, QUANTIZE: tl.constexpr):
    """Values as an fp8 cache holds them when QUANTIZE (fp32: divided by the scale, SCALE_MODE as
    `validation.scale_argument`, and saturated to float8_e4m3fn's finite range); else x as it is.
    Shared with `kernels.qkv_epilogue`."""
    if QUANTIZE:
        x = x.to(tl.float32)
        if SCALE_MODE == 2:
            x = x / tl.load(scale).to(tl.float32)
        elif SCALE_MODE == 1:
            x = x / scale
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return x


@triton.jit
def _store_row(src_ptr, dst_ptr, token, block, offset, heads, dims, keep, scale,
               stride_sn, stride_sh, stride_sd, stride_db, stride_dt, stride_dh, stride_dd,
               SCALE_MODE: tl.constexpr, QUANTIZE: tl.constexpr):
    # src [N, NKV, D] row `token` -> dst [blocks, tpb, NKV, D] at (block, offset)
    mask = keep[:, None]
    src = src_ptr + token * stride_sn + heads[:, None] * stride_sh + dims[None, :] * stride_sd
    row = cache_values(tl.load(src, mask=mask, other=0.0), scale, SCALE_MODE, QUANTIZE)
    dst = (dst_ptr + block * stride_db + offset * stride_dt + heads[:, None] * stride_dh
           + dims[None, :] * stride_dd)
    tl.store(dst, row.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # a view at any offset of a step's slots
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale, v_scale, num_kv_heads,
    stride_kn, stride_kh, stride_kd, stride_vn, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd, stride_vcb, stride_vct, stride_vch, stride_vcd,
    TOKENS_PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
    K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr, QUANTIZE: tl.constexpr,
):
    # one program per row: all NKV heads x D of token `token`
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # a negative slot (PAD_SLOT) skips the row; compared as a [HEADS_PAD] vector so the mask is a tensor
    keep = (heads < num_kv_heads) & ((tl.zeros([HEADS_PAD], dtype=tl.int64) + slot) >= 0)
    safe = tl.maximum(slot, 0)
    block = safe // TOKENS_PER_BLOCK
    offset = safe % TOKENS_PER_BLOCK
    _store_row(k_ptr, k_cache_ptr, token, block, offset, heads, dims, keep, k_scale,
               stride_kn, stride_kh, stride_kd, stride_kcb, stride_kct, stride_kch, stride_kcd,
               K_SCALE_MODE, QUANTIZE)
    _store_row(v_ptr, v_cache_ptr, token, block, offset, heads, dims, keep, v_scale,
               stride_vn, stride_vh, stride_vd, stride_vcb, stride_vct, stride_vch, stride_vcd,
               V_SCALE_MODE, QUANTIZE)


def _to_cache_dtype(rows: torch.Tensor, cache_dtype: torch.dtype, scale) -> torch.Tensor:
    """Torch conversion with the kernel's rule (for the interpreter, which rounds bf16/fp8 wrongly)."""
    if cache_dtype != FP8:
        return rows.to(cache_dtype)
    divisor = scale.float() if isinstance(scale, torch.Tensor) else (1.0 if scale is None else float(scale))
    return (rows.float() / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _launch_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    num_rows, num_kv_heads, head_dim = k.shape
    quantize = k_cache.dtype == FP8
    if not quantize:  # scales only quantise (as in the reference)
        k_scale = v_scale = None
    if k.device.type != "cuda":
        # The interpreter has no bf16/fp8 rounding: convert with torch here, the kernel only scatters.
        k = _to_cache_dtype(k, k_cache.dtype, k_scale)
        v = _to_cache_dtype(v, v_cache.dtype, v_scale)
        k_scale = v_scale = None
        quantize = False
    k_arg, k_mode = scale_argument(k_scale)
    v_arg, v_mode = scale_argument(v_scale)
    _store_kv_kernel[(num_rows,)](
        k, v, k_cache, v_cache, slot_mapping, k_arg, v_arg, num_kv_heads,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        TOKENS_PER_BLOCK=k_cache.shape[1], HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), K_SCALE_MODE=k_mode, V_SCALE_MODE=v_mode,
        QUANTIZE=quantize, num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def check_store_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    check_rank(k, 3, "k", "[N, NKV, D]")
    check_rank(v, 3, "v", "[N, NKV, D]")
    _, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    want = (k.shape[0], num_kv_heads, head_dim)
    for name, rows in (("k", k), ("v", v)):
        if tuple(rows.shape) != want:
            raise ValueError(f"{name} must be [N, NKV, D] = {want} to match the cache, got "
                             f"{tuple(rows.shape)}")
        if rows.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"{name} must be bf16, fp16 or fp32, got {rows.dtype}")
    check_index_tensor(slot_mapping, (k.shape[0],), "slot_mapping", "[N]", (torch.int32, torch.int64))
    check_same_device(k.device, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_scale(k_scale, "k_scale", k.device)
    check_scale(v_scale, "v_scale", k.device)


def store_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, backend="auto") -> None:
    """Write K/V rows into the pages of one layer, in place.

    Parameters
    ----------
    k, v : Tensor [N, NKV, D], bf16 / fp16 / fp32
        The rows to store (for the drafter: k after k_norm and RoPE).
    k_cache, v_cache : Tensor [num_blocks, tokens_per_block, NKV, D], any strides
        Layer views of a pool arena, bf16 / fp16 / fp32 or float8_e4m3fn.
    slot_mapping : Tensor [N], int32 or int64
        Row i goes to block slot // tokens_per_block, offset slot % tokens_per_block; PAD_SLOT (-1)
        skips the row. Not read on the host (graph safe); slots must be in range.
    k_scale, v_scale : float or 0-d tensor, optional
        Used by fp8 caches only: stored = row / scale (value = stored x scale when read); None = 1.
    backend : "auto" | "triton" | "torch"
        See `kernels.dispatch`.
    """
    check_store_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if resolve_backend(backend, k.device) == "torch":
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    if k.shape[0] == 0:
        return
    _launch_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
