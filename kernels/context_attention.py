"""DFlash draft cross-attention: the noise block attends over paged context plus the dense noise.

Per request b and KV head h, the Q noise queries of the group's heads (R = Q x group rows,
padded to a power of two >= 16) attend, with ONE softmax and no mask, over the ctx_lens[b]
context keys stored in the pool's pages and the Q noise keys, which are never stored. The rows
are packed into one tile so every K/V tile is read once per KV head.

Two paths over one kernel:
- split (small batches): grid (NKV, B, max_splits); each request takes a length-aware number of
  splits decided on the device (`kernels.split_kv`); split 0 also folds the noise suffix, so its
  partial state always holds at least Q keys; a one-split request is finished by split 0 alone,
  otherwise a merge kernel folds the partials into the output.
- single pass (the batch alone fills the GPU): grid (NKV, B); context then noise, output direct.
The grid depends on B only, and the split count is a runtime argument: a CUDA graph captured
once replays for any context lengths, and a new batch size does not recompile.

This module validates, picks the launch shape and the operand dtypes, and launches; the Triton
kernels are in `kernels.context_attention_kernel`, the torch oracle with the same signature in
`kernels.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import operands, pdl, reference, split_kv
from kernels.context_attention_kernel import _context_attention_kernel, _context_merge_kernel
from kernels.dispatch import resolve_backend
from kernels.paged_tiles import DOUBLE_BUFFER_MAX_HEAD_DIM, DOUBLE_BUFFER_STAGES
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

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LaunchConfig:
    """Tile and warp choices of one launch (tuned on an H200; the bench sweeps them)."""

    block_n: int = 64  # context keys per tile
    num_warps: int = 4
    num_stages: int = 3
    merge_rows: int = 16  # rows x columns of one merge program: 16 x 32 was 4-9% faster per call than
    # 16 x 16 at B 1-16 (split path, ctx 8192; context_latency_merge, git history)
    merge_cols: int = 32
    merge_chunk: int = 32  # splits one merge step loads at once


def default_config(rows_pad: int, cache_dtype: torch.dtype, device: torch.device,
                   head_dim: int = 128) -> LaunchConfig:
    """Measured on an H200 (context_attention_run3 (git history), tile sweep; the stages:
    kernel_variants_15_stages (git history), _16_stages and _17_stages).

    A 16-bit context takes DOUBLE_BUFFER_STAGES (5, as the paged kernel's decode-size tiles), the
    first count at which Triton double-buffers its K/V behind the page-id loads in an offline sm_90
    build (3 keep one buffer): side by side, the single pass 4-11% faster at B 64-256 (NKV 4 B 256
    ctx 8192: 90% -> 99% of copy), the split path 3-16% (B 1 NKV 4 ctx 8192: 15.9 -> 15.4 us; B 4
    NKV 8 ctx 32768: 165.5 -> 139.4); 7 stages 0-9% slower. An fp8 context keeps 3 (5 stages: 6-28%
    slower), and so does a head dim above DOUBLE_BUFFER_MAX_HEAD_DIM (measured at 128 only; three
    buffers of D 256 tiles would not fit in shared memory).
    """
    if device.type != "cuda":  # the interpreter: small tiles run faster in numpy
        return LaunchConfig(block_n=32, num_warps=4, num_stages=1, merge_chunk=4)
    if rows_pad >= 128:  # a 128 x D fp32 accumulator wants 8 warps' registers
        return LaunchConfig(block_n=64, num_warps=8, num_stages=2)
    if cache_dtype == FP8:  # half the bytes per tile: longer tiles amortise the widening to 16 bit
        return LaunchConfig(block_n=128, num_warps=4, num_stages=3)
    if head_dim > DOUBLE_BUFFER_MAX_HEAD_DIM:
        return LaunchConfig(block_n=64, num_warps=4, num_stages=3)
    return LaunchConfig(block_n=64, num_warps=4, num_stages=DOUBLE_BUFFER_STAGES)


# p x v_scale feeds the fp16 MMA over an fp8 context, so a Python-float v_scale above this keeps
# q's dtype (a device-tensor v_scale cannot be read on the host: an e4m3 cache's scale, amax / 448,
# stays far below it).
FP16_MAX_V_SCALE = 60000.0


class Operands(NamedTuple):
    """What one launch feeds its dots."""

    context: tl.dtype  # the context tiles' MMA operands
    noise: tl.dtype  # the noise tile's (q's dtype)
    precision: str  # tl.dot's input_precision
    narrow_q: bool  # q shifted into fp16's range (`operands.fp16_range_shift`)
    fp8_q: bool  # context scores in e4m3 (`operands.quantize_rows_e4m3`)


def _operands(q: torch.Tensor, cache_dtype: torch.dtype, v_scale, rows: int) -> Operands:
    """`kernels.operands` picks the context tiles' dtype; the noise tile keeps q's.

    An fp32 q (or the interpreter) computes everything in exact fp32.
    """
    if q.device.type != "cuda" or q.dtype == torch.float32:
        return Operands(tl.float32, tl.float32, "ieee", False, False)
    big_v_scale = isinstance(v_scale, (int, float)) and v_scale > FP16_MAX_V_SCALE
    context = q.dtype if big_v_scale else operands.mma_dtype(q.dtype, cache_dtype, q.device)
    fp8_q = operands.quantizes_q(cache_dtype, q.device, rows, q.shape[-1])
    return Operands(operands.TL_DTYPES[context], operands.TL_DTYPES[q.dtype], "tf32",  # tf32: the default
                    operands.narrows_q(context, q.dtype), fp8_q)


def _launch_context_attention(q, k_cache, v_cache, block_table, ctx_lens, k_noise, v_noise, out,
                              scale, k_scale, v_scale, max_splits, min_tokens, config: LaunchConfig):
    """Grid, tiles and (on the split path) partial buffers and the merge; only launches.

    Each request takes clamp(ctx_len // min_tokens, 1, max_splits) splits, decided on the device.
    """
    batch, num_q, num_heads, head_dim = q.shape
    tokens_per_block, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows_pad = max(16, triton.next_power_of_2(num_q * group))
    noise_pad = max(16, triton.next_power_of_2(num_q))
    merge_rows, merge_cols = min(config.merge_rows, rows_pad), min(config.merge_cols, head_dim)
    num_tiles = rows_pad // merge_rows * (head_dim // merge_cols)
    split = max_splits > 1
    if split:
        part_acc, part_lse = split_kv.alloc_partials(batch * num_kv_heads * rows_pad, max_splits, head_dim,
                                                     q.device)
    else:
        part_acc = part_lse = out  # unused by the single-pass variant
    k_arg, k_mode = scale_argument(k_scale)
    v_arg, v_mode = scale_argument(v_scale)
    dots = _operands(q, k_cache.dtype, v_scale, rows_pad)
    use_pdl = pdl.use_pdl(q.device)
    sm_scale_log2 = scale * LOG2E
    part_strides = (part_acc.stride(0), part_acc.stride(1), part_lse.stride(0), part_lse.stride(1)) if split \
        else (0, 0, 0, 0)
    _context_attention_kernel[(num_kv_heads, batch, max_splits)](
        q, k_cache, v_cache, block_table, ctx_lens, k_noise, v_noise, out, part_acc, part_lse,
        k_arg, v_arg, sm_scale_log2, num_q, max_splits, min_tokens,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        *k_noise.stride(), *v_noise.stride(), *out.stride(), *part_strides,
        GROUP=group, HEAD_DIM=head_dim, TOKENS_PER_BLOCK=tokens_per_block, ROWS=rows_pad,
        NOISE_PAD=noise_pad, BLOCK_N=config.block_n, SPLIT=split, K_SCALE_MODE=k_mode,
        V_SCALE_MODE=v_mode, COMPUTE=dots.context, NOISE_COMPUTE=dots.noise, NARROW_Q=dots.narrow_q,
        PRECISION=dots.precision, USE_PDL=use_pdl, FP8_CVT_ASM=operands.fp8_cvt_asm(q.device),
        FP8_Q=dots.fp8_q, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=use_pdl,
    )
    if split:
        _context_merge_kernel[(num_tiles, num_kv_heads, batch)](
            part_acc, part_lse, ctx_lens, out, num_q, max_splits, min_tokens, *part_strides, *out.stride(),
            GROUP=group, HEAD_DIM=head_dim, ROWS=rows_pad, MERGE_ROWS=merge_rows, MERGE_COLS=merge_cols,
            MERGE_CHUNK=config.merge_chunk, USE_PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
        )
    return out


def _check_inputs(q, k_cache, v_cache, block_table, ctx_lens, k_noise, v_noise, scale, k_scale, v_scale,
                  out):
    check_rank(q, 4, "q", "[B, Q, NH, D]")
    if q.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    batch, num_q, num_heads, head_dim = q.shape
    _, num_kv_heads, cache_dim = check_cache_pair(k_cache, v_cache)
    if cache_dim != head_dim:
        raise ValueError(f"q head dim {head_dim} differs from the cache head dim {cache_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads NH={num_heads} must be a multiple of KV heads NKV={num_kv_heads}")
    if num_q < 1:
        raise ValueError("q must hold at least one query position (Q >= 1)")
    if k_cache.dtype not in (q.dtype, FP8):
        raise ValueError(f"cache dtype {k_cache.dtype} must equal q's ({q.dtype}) or be float8_e4m3fn")
    noise_shape = (batch, num_q, num_kv_heads, head_dim)
    for name, noise in (("k_noise", k_noise), ("v_noise", v_noise)):
        check_rank(noise, 4, name, "[B, Q, NKV, D]")
        if tuple(noise.shape) != noise_shape or noise.dtype != q.dtype:
            raise ValueError(f"{name} must be {q.dtype} {noise_shape}, got {noise.dtype} "
                             f"{tuple(noise.shape)}")
    check_index_tensor(block_table, (batch, None), "block_table", "[B, max_blocks]")
    check_index_tensor(ctx_lens, (batch,), "ctx_lens", "[B]")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    check_same_device(q.device, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                      ctx_lens=ctx_lens, k_noise=k_noise, v_noise=v_noise, out=out)
    check_scale(k_scale, "k_scale", q.device)
    check_scale(v_scale, "v_scale", q.device)
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive Python number or None, got {scale!r}")


def paged_context_attention(q, k_cache, v_cache, block_table, ctx_lens, k_noise, v_noise, *, scale=None,
                            k_scale=None, v_scale=None, num_splits=None, out=None, backend="auto"):
    """DFlash draft cross-attention over the paged context plus the dense noise block, one softmax.

    Parameters
    ----------
    q : Tensor [B, Q, NH, D], bf16 / fp16 / fp32
        The noise block's queries, after q_norm and RoPE. NH = group x NKV (GQA).
    k_cache, v_cache : Tensor [num_blocks, tokens_per_block, NKV, D], any strides
        Layer views of a pool arena: q's dtype, or float8_e4m3fn with `k_scale` / `v_scale`.
        tokens_per_block and D are powers of two >= 16.
    block_table : Tensor [B, max_blocks], int32
        Block ids of each request; position p lives at (block_table[b, p // tpb], p % tpb).
    ctx_lens : Tensor [B], int32, on q's device
        Context positions 0..ctx_lens[b]-1 of each request are attended; 0 is allowed. Not read
        on the host (graph safe); each must fit its block table row.
    k_noise, v_noise : Tensor [B, Q, NKV, D], q's dtype
        The noise block's own keys and values, attended densely and never stored.
    scale : float, optional
        Softmax scale, D ** -0.5 by default.
    k_scale, v_scale : float or 0-d tensor, optional
        Dequantisation scales of the cache (value = stored x scale); None means 1.
    num_splits : int, optional
        Forces the split grid (1 = the single-pass kernel); by default chosen from B x NKV.
    out : Tensor [B, Q, NH, D], q's dtype, optional
        Written in place and returned.
    backend : "auto" | "triton" | "torch"
        See `kernels.dispatch`.

    Returns
    -------
    Tensor [B, Q, NH, D] in q's dtype: every query row attends over all ctx_lens[b] context
    keys and all Q noise keys of its KV head, with no mask.
    """
    _check_inputs(q, k_cache, v_cache, block_table, ctx_lens, k_noise, v_noise, scale, k_scale, v_scale, out)
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_splits = split_kv.plan_max_splits(max(batch, 1) * num_kv_heads, q.device, num_splits)
    scale = head_dim**-0.5 if scale is None else float(scale)
    if resolve_backend(backend, q.device) == "torch":
        return reference.paged_context_attention(
            q, k_cache, v_cache, block_table, ctx_lens, k_noise, v_noise, scale=scale, k_scale=k_scale,
            v_scale=v_scale, out=out)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    rows_pad = max(16, triton.next_power_of_2(num_q * (num_heads // num_kv_heads)))
    # a forced count splits every context into exactly that many (some empty when short)
    min_tokens = 1 if num_splits is not None else split_kv.min_tokens_per_split(rows_pad)
    return _launch_context_attention(q, k_cache, v_cache, block_table, ctx_lens, k_noise, v_noise, out,
                                     scale, k_scale, v_scale, max_splits, min_tokens,
                                     default_config(rows_pad, k_cache.dtype, q.device, head_dim))
