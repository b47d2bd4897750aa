"""The dtype the attention kernels feed their MMAs, shared by the paged and the context kernel.

On a GPU the dots take q's 16-bit dtype, except over an fp8 (e4m3) cache, which is widened to
`FP8_WIDEN_DTYPE`: fp16 holds every e4m3 value exactly and sm_90 widens a pair of them in one
instruction where bf16 takes several (6-22% faster on an H200, bench/results/fp8_operands*.md).
A bf16 q is then narrowed to fp16 with `fp16_range_shift`, a power-of-two shift that keeps even
an out-of-range q finite and exact up to fp16 rounding. The interpreter has no 16-bit math, so
off the GPU every operand is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# What an fp8 cache widens to for the MMAs (None: q's dtype). bench/fp8_operands.py switches it.
FP8_WIDEN_DTYPE: torch.dtype | None = torch.float16
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def mma_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Operand dtype of the dots over a `cache_dtype` cache for a `q_dtype` query on `device`."""
    if device.type != "cuda":
        return torch.float32
    if cache_dtype == torch.float8_e4m3fn and FP8_WIDEN_DTYPE is not None:
        return FP8_WIDEN_DTYPE
    return q_dtype


def narrows_q(mma: torch.dtype, q_dtype: torch.dtype) -> bool:
    """Whether q must be shifted into fp16's range before it becomes an `mma` operand."""
    return mma == torch.float16 and q_dtype != torch.float16


@triton.jit
def fp16_range_shift(q):
    """(q * 2**-shift, shift) with the tile's largest |q| at most 32768: exact, and finite in fp16.

    Multiply the score scale by 2**shift to undo it. shift is 0 for any q already in range.
    """
    amax = tl.max(tl.max(tl.abs(q), 1), 0)
    shift = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1.0) / 32768.0)), 0.0)
    return q * tl.exp2(-shift), shift
