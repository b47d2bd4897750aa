"""The dtype the attention kernels feed their MMAs, shared by the paged and the context kernel.

On a GPU the dots take q's 16-bit dtype, except over an fp8 (e4m3) cache, which is widened to
fp16: fp16 holds every e4m3 value exactly and sm_90 widens a pair of them in one instruction where
bf16 takes several (6-22% faster on an H200, measured against bf16 operands in the fp8 operands
experiment, in git history).
A bf16 q is then narrowed to fp16 with `fp16_range_shift`, a power-of-two shift that keeps even
an out-of-range q finite and exact up to fp16 rounding. The interpreter has no 16-bit math, so
off the GPU every operand is fp32.

`widen_values` widens an fp8 value tile [keys, D] for the P V product. Triton would otherwise load
the fp8 bytes from shared memory straight into the MMA's register layout, where the keys (the
reduction axis) are not contiguous: byte-wise shared loads (1 per element) and register moves. On
sm_89+ (`fp8_cvt_asm`) the widening is an opaque inline-asm step that Triton does not move past the
layout change, so the tile is widened in its load layout and reaches the MMA through a 16-bit
transposing ldmatrix, as a bf16 tile does (bench/bench_kernel_sass.py, an offline sm_90 build: the paged
decode kernel loses 256 byte loads and 169 moves per thread; on an H200 fp8 decode got 2-5%
faster, measured in the kernel variants experiment, in git history). Tiles of 64+ rows use the
Hopper MMA, whose operands already pass through registers: the same shared loads and MMAs either
way. Both attention kernels widen their values so.

Where `quantizes_q` says so, the score dot over an fp8 cache runs in e4m3 itself, so the key tiles
reach the MMA as stored, without a widening: q is split per row into two e4m3 terms
(`quantize_rows_e4m3`, the row's scale folded into its score scale) and both are dotted with the
same key tile, which keeps q's precision (one e4m3 term alone would trade q's 8-bit mantissa for 3
bits). Two e4m3 MMAs cost the tensor cores what one 16-bit MMA does. Triton runs e4m3 dots natively
on sm_90 only in the Hopper MMA (tiles of 64+ rows; smaller tiles would widen both operands to fp16
again, per an offline sm_90 build), so `quantizes_q` asks for 64 rows, and for a head dim of 32+
(the e4m3 MMA's reduction step). The P V product keeps 16-bit operands.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)  # largest finite e4m3fn
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def mma_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Operand dtype of the dots over a `cache_dtype` cache for a `q_dtype` query on `device`."""
    if device.type != "cuda":
        return torch.float32
    if cache_dtype == torch.float8_e4m3fn:
        return torch.float16
    return q_dtype


def narrows_q(mma: torch.dtype, q_dtype: torch.dtype) -> bool:
    """Whether q must be shifted into fp16's range before it becomes an `mma` operand."""
    return mma == torch.float16 and q_dtype != torch.float16


def fp8_cvt_asm(device: torch.device) -> bool:
    """Whether `widen_values` may use the e4m3 -> f16x2 conversion instruction (sm_89 and later)."""
    if device.type != "cuda":
        return False
    return _has_fp8_cvt(_index(device))


def quantizes_q(cache_dtype: torch.dtype, device: torch.device, rows: int, head_dim: int) -> bool:
    """Whether the score dot of `rows`-row tiles over a `cache_dtype` cache runs in e4m3.

    Wherever the Hopper MMA takes it: 8-17% faster fp8 verify and context on an H200 at equal
    accuracy (the fp8 operand comparison of e617980, in git history). The e4m3 MMA reduces 32
    elements per step: a head dim of 16 keeps the fp16 dot, as do smaller tiles and other GPUs.
    """
    return (cache_dtype == torch.float8_e4m3fn and rows >= 64 and head_dim >= 32
            and is_hopper(device))


def is_hopper(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (sm_90), where the kernels' Hopper-only choices were measured."""
    return device.type == "cuda" and _is_hopper(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


@functools.cache
def _has_fp8_cvt(device_index: int) -> bool:  # asked on every launch: once per device
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


@triton.jit
def _e4m3x4_to_f16(x):
    # 4 e4m3 bytes of one 32-bit register -> 4 halves in two; not pure, so never hoisted
    return tl.inline_asm_elementwise(
        asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def widen_values(v, DOT_DTYPE: tl.constexpr, CVT_ASM: tl.constexpr):
    """A value tile in DOT_DTYPE; an e4m3 tile widened to fp16 in its load layout when CVT_ASM."""
    if CVT_ASM and v.dtype == tl.float8e4nv and tl.float16 == DOT_DTYPE:
        return _e4m3x4_to_f16(v)
    else:
        return v.to(DOT_DTYPE)


@triton.jit
def fp16_range_shift(q):
    """(q * 2**-shift, shift) with the tile's largest |q| at most 32768: exact, and finite in fp16.

    Multiply the score scale by 2**shift to undo it. shift is 0 for any q already in range.
    """
    amax = tl.max(tl.max(tl.abs(q), 1), 0)
    shift = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1.0) / 32768.0)), 0.0)
    return q * tl.exp2(-shift), shift


@triton.jit
def quantize_rows_e4m3(q):
    """(hi, lo, s): q ~ s * (hi + lo) per row in two e4m3 terms, s = max |q row| / 448.

    hi is q / s rounded to e4m3 and lo the remainder rounded again, so ``dot(lo, k, dot(hi, k))``
    is q.k / s to about 2**-8 of the row's scale (bf16-class: 6e-4 relative L2 on random rows,
    where hi alone loses 2.6e-2). A zero row takes s = 1. Multiply each row's score scale by s.
    """
    amax = tl.max(tl.abs(q), 1)
    s = tl.where(amax > 0.0, amax / E4M3_MAX, 1.0)
    scaled = tl.minimum(tl.maximum(q / s[:, None], -E4M3_MAX), E4M3_MAX)  # rounding may touch 448
    hi = scaled.to(tl.float8e4nv)
    lo = (scaled - hi.to(tl.float32)).to(tl.float8e4nv)
    return hi, lo, s


@triton.jit
def score_operands(q, score_scale, DOT_DTYPE: tl.constexpr, NARROW_Q: tl.constexpr, FP8_Q: tl.constexpr):
    """An fp32 q tile [rows, D] as the score dot's operands: (q, q_lo, score_scale [rows]).

    FP8_Q: q's two e4m3 terms (`quantize_rows_e4m3`) with each row's scale joined to its score
    scale. Otherwise q in DOT_DTYPE, shifted into fp16's range first when NARROW_Q (the shift joins
    the score scale), and q_lo is q again (the fp16 dot takes one term).
    """
    if FP8_Q:
        q, q_lo, row_scale = quantize_rows_e4m3(q)
        return q, q_lo, score_scale * row_scale
    else:
        if NARROW_Q:
            q, shift = fp16_range_shift(q)
            score_scale = score_scale * tl.exp2(shift)
        q = q.to(DOT_DTYPE)
        return q, q, score_scale
