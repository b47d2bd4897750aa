"""Target causal attention over paged K/V: one kernel for prefill chunks, verify blocks and decode.

`paged_attention` validates, takes the tiles and the split plan from `kernels.paged_tiles` (static
shapes alone: no device sync, so a CUDA graph captures it), launches `kernels.paged_attention_kernel`
and, when the keys were split, the shared merge of `kernels.split_kv`. The torch oracle with the same
signature is `kernels.reference.paged_attention`; backend "auto" runs it on CPU tensors.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import triton

from kernels import operands, paged_tiles, pdl, reference, split_kv
from kernels.dispatch import resolve_backend
from kernels.paged_attention_kernel import _paged_attention_kernel, launch_grid
from kernels.paged_tiles import TileConfig

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (*Q_DTYPES, torch.float8_e4m3fn)
MAX_HEAD_DIM = 256
# fp32 elements of partial state one fused-merge step holds per thread (register budget).
FUSED_MERGE_ELEMENTS_PER_THREAD = 64


def _is_scale(value) -> bool:
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_inputs(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, k_scale, v_scale,
                  num_splits, out) -> None:
    """Shapes, dtypes, devices and scalars: every check that needs no device sync."""
    if q.dim() != 3 or q.dtype not in Q_DTYPES or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, NH, D] fp16/bf16/fp32 with unit last stride, got {q.dtype} "
                         f"{tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, tokens_per_block, NKV, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"k_cache/v_cache dtype must be one of {CACHE_DTYPES} and equal, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a unit stride on the head dim")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim of q ({head_dim}) and cache ({k_cache.shape[3]}) must match and be "
                         f"<= {MAX_HEAD_DIM}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 [B + 1] = [{batch + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [B, max_blocks] with B = {batch}, got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with unit last stride, got "
                         f"{out.dtype} {tuple(out.shape)}")
    tensors = [q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, k_scale, v_scale]
    if any(isinstance(t, torch.Tensor) and t.device != q.device for t in tensors):
        raise ValueError(f"every tensor argument must be on q's device ({q.device})")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    if not (_is_scale(k_scale) and _is_scale(v_scale)):
        raise ValueError("k_scale and v_scale must each be None, a positive number or a 1-element float "
                         f"tensor, got {k_scale!r} and {v_scale!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= split_kv.MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int in [1, {split_kv.MAX_SPLITS}], got "
                         f"{num_splits!r}")


def _check_values(q, k_cache, block_table, seq_lens, query_start_loc) -> None:
    """Lengths and page ids against each other; reads values, so only for tensors on the CPU."""
    starts = query_start_loc.tolist()
    q_lens = [hi - lo for lo, hi in itertools.pairwise(starts)]
    if starts[0] != 0 or min(q_lens, default=0) < 0 or starts[-1] > q.shape[0]:
        raise ValueError(f"query_start_loc must start at 0, never decrease and end <= T = {q.shape[0]}, "
                         f"got {starts}")
    tokens_per_block = k_cache.shape[1]
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len < q_lens[b]:
            raise ValueError(f"seq_lens[{b}] = {seq_len} is below its query count {q_lens[b]}: the "
                             f"queries' own K/V must be stored first")
        pages = triton.cdiv(seq_len, tokens_per_block)
        if pages > block_table.shape[1]:
            raise ValueError(f"seq_lens[{b}] = {seq_len} needs {pages} pages but block_table has "
                             f"{block_table.shape[1]} columns")
        ids = block_table[b, :pages]
        if pages and (ids.min() < 0 or ids.max() >= k_cache.shape[0]):
            raise ValueError(f"block_table[{b}] uses page ids outside [0, {k_cache.shape[0]})")


def _scale_args(k_scale, v_scale, device):
    """(k float, v float, k tensor, v tensor, on_device): device tensors are read in the kernel."""
    if not isinstance(k_scale, torch.Tensor) and not isinstance(v_scale, torch.Tensor):
        k_value = 1.0 if k_scale is None else float(k_scale)
        v_value = 1.0 if v_scale is None else float(v_scale)
        return k_value, v_value, None, None, False
    as_tensor = lambda s: (s.reshape(1) if isinstance(s, torch.Tensor)
                           else torch.full((1,), 1.0 if s is None else float(s), device=device))
    return 1.0, 1.0, as_tensor(k_scale), as_tensor(v_scale), True


def _fused_merge_chunk(tiles: TileConfig, d_pad: int) -> int:
    """Splits one fused-merge step loads: a [BLOCK_M, chunk, D] fp32 block within the register budget."""
    elements = FUSED_MERGE_ELEMENTS_PER_THREAD * 32 * tiles.num_warps
    chunk = 2
    while chunk < 16 and tiles.block_m * 2 * chunk * d_pad <= elements:
        chunk *= 2
    return chunk


class LaunchPlan(NamedTuple):
    """How one call launches: the tiles, the split plan, and the choices made from them."""

    tiles: TileConfig
    max_splits: int
    min_tokens: int  # per split
    fused: bool  # the last split of each work item merges the partials (no merge kernel)
    merge_chunk: int
    seq_search: int

    @property
    def split(self) -> bool:
        return self.max_splits > 1

    @property
    def variant(self) -> tuple:
        """What the kernel is compiled for: the plan's constexprs and launch options. The split
        count and floor are run-time arguments (never specialised), so they are not in it."""
        return self.tiles, self.split, self.fused, self.merge_chunk, self.seq_search


def plan_launch(num_tokens: int, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                device: torch.device, cache_dtype: torch.dtype, q_dtype: torch.dtype,
                num_splits: int | None = None, tiles: TileConfig | None = None, *,
                fused_merge_max_splits: int = 4, seq_search: int = 64) -> LaunchPlan:
    """The launch of a call with these static shapes (see `_launch_paged_attention` for the knobs)."""
    if tiles is None:
        tiles, max_splits, min_tokens = paged_tiles.default_plan(
            num_tokens, batch, num_heads, num_kv_heads, head_dim, device, cache_dtype, q_dtype, num_splits)
    else:
        paged_tiles.check_tiles(tiles)
        num_items = paged_tiles.work_items(num_tokens, batch, num_kv_heads, tiles)
        max_splits, min_tokens = paged_tiles.split_plan(num_items, num_heads, head_dim, tiles, num_splits,
                                                        device)
    fused = max_splits > 1 and num_tokens > batch and max_splits <= fused_merge_max_splits
    d_pad = max(16, triton.next_power_of_2(head_dim))
    return LaunchPlan(tiles, max_splits, min_tokens, fused, _fused_merge_chunk(tiles, d_pad),
                      seq_search if num_tokens > batch else 1)


def _launch_paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, k_scale,
                            v_scale, num_splits, out, tiles: TileConfig | None = None, *,
                            fused_merge_max_splits: int = 4, seq_search: int = 64):
    """Plan (unless `tiles` is given), launch the kernel and, for a split not merged in it, the merge.

    fused_merge_max_splits: verify and prefill batches split at most this many ways merge in the
    last split of each (query tile, KV head) to finish, with no merge kernel: 5-10% faster at B 8-16,
    q_len 8 on an H200. Decode, whose merge kernel is small, and deeper splits, whose merge steps
    run one after another in that one program, keep the merge kernel. 0 always takes the kernel.

    seq_search: query_start_loc entries a program of a verify or prefill batch loads at once to
    find its sequence: one round trip for B < 64 where a binary search waits log2(B) dependent
    loads (bf16 verify 1-4% faster on an H200). Decode batches keep the binary search: up to 5%
    slower with it (fp8, B >= 32). 1 bisects everywhere.

    Both defaults were measured in the latency ablation of e900176 (in git history); the tests pass
    other values to reach the other path.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    plan = plan_launch(num_tokens, batch, num_heads, num_kv_heads, head_dim, q.device, k_cache.dtype, q.dtype,
                       num_splits, tiles, fused_merge_max_splits=fused_merge_max_splits,
                       seq_search=seq_search)
    tiles, max_splits, min_tokens, fused, merge_chunk = plan[:5]
    split = plan.split
    grid = launch_grid(num_tokens, batch, num_kv_heads, max_splits, tiles.block_q)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if split:
        part_acc, part_lse = split_kv.alloc_partials(num_tokens * num_heads, max_splits, head_dim, q.device)
        split_lens = torch.empty(num_tokens, dtype=torch.int32, device=q.device)
    else:
        part_acc, part_lse, split_lens = q, q, seq_lens  # placeholders, never touched
    counters = split_kv.arrival_counters(grid[0] * grid[1], q.device) if fused else seq_lens
    k_value, v_value, k_tensor, v_tensor, on_device = _scale_args(k_scale, v_scale, q.device)
    dot_dtype = operands.mma_dtype(q.dtype, k_cache.dtype, q.device)
    use_pdl = pdl.use_pdl(q.device)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_lse, split_lens, counters,
        block_table, seq_lens, query_start_loc, k_tensor if on_device else q, v_tensor if on_device else q,
        scale or head_dim**-0.5, k_value, v_value, batch, max_splits, min_tokens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        part_acc.stride(0) if split else 0, part_acc.stride(1) if split else 0,
        part_lse.stride(0) if split else 0, part_lse.stride(1) if split else 0,
        block_table.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        D_PAD=d_pad, BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        TOKENS_PER_BLOCK=k_cache.shape[1], SCALES_ON_DEVICE=on_device, SPLIT=split,
        FUSED_MERGE=fused, MERGE_CHUNK=merge_chunk, DOT_DTYPE=operands.TL_DTYPES[dot_dtype], USE_PDL=use_pdl,
        SEQ_SEARCH=plan.seq_search,
        NARROW_Q=operands.narrows_q(dot_dtype, q.dtype), FP8_CVT_ASM=operands.fp8_cvt_asm(q.device),
        FP8_Q=operands.quantizes_q(k_cache.dtype, q.device, tiles.block_m, d_pad),
        KEY_LANES=tiles.key_lanes,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=use_pdl,
    )
    if split and not fused:
        rows_out = out.view(num_tokens * num_heads, head_dim) if out.is_contiguous() else torch.empty(
            num_tokens * num_heads, head_dim, dtype=out.dtype, device=out.device)
        split_kv.merge_partials(part_acc, part_lse, split_lens, rows_out, rows_per_length=num_heads,
                                max_splits=max_splits, min_tokens_per_split=min_tokens)
        if not out.is_contiguous():
            out.copy_(rows_out.view(num_tokens, num_heads, head_dim))
    return out


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
    *, scale=None, k_scale=None, v_scale=None, num_splits=None, out=None, backend="auto",
) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' paged K/V.

    Query i of sequence b sits at position ``seq_lens[b] - q_len_b + i`` and attends to every key at
    a position <= its own. Prefill chunks (part of the prompt possibly cached), verify blocks and
    decode mix freely in one call.

    Parameters
    ----------
    q : Tensor [T, NH, D], fp16 / bf16 / fp32
        The queries of B sequences, packed back to back; unit stride on D.
    k_cache, v_cache : Tensor [num_blocks, tokens_per_block, NKV, D], fp16 / bf16 / fp32 / fp8 e4m3
        One layer's pages (any strides but a unit one on D); NH must be a multiple of NKV. This
        step's K/V must already be stored (`kernels.store_kv`).
    block_table : Tensor [B, max_blocks], int32
        Page ids of each sequence, in position order.
    seq_lens : Tensor [B], int32
        Tokens in the cache per sequence INCLUDING this step's queries.
    query_start_loc : Tensor [B + 1], int32
        Cumulative query counts (0, q_len_0, q_len_0 + q_len_1, ...); rows past its last value
        (CUDA-graph padding) are left unspecified.
    scale : float, optional
        Softmax scale, default ``D ** -0.5``.
    k_scale, v_scale : float or 1-element float Tensor, optional
        Dequantization factors of an fp8 cache (stored = value / scale). A tensor is read on the
        device, so a captured graph follows its updates.
    num_splits : int, optional
        Force the split-KV grid to this many splits per sequence (each at least one key tile).
        None plans it from shapes (small batches of long sequences split, chosen per sequence on
        the device from its length).
    out : Tensor [T, NH, D], q's dtype, optional
        Written in place and returned.
    backend : {"auto", "triton", "torch"}
        See `kernels.dispatch`.

    Returns
    -------
    Tensor [T, NH, D] in q's dtype.

    Raises
    ------
    ValueError
        On shapes, dtypes, devices or scalars the kernel does not take; for CPU tensors also on
        inconsistent lengths or page ids (on a GPU those are the caller's contract: checking them
        would need a device sync, which a captured graph cannot take).
    """
    _check_inputs(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, k_scale, v_scale,
                  num_splits, out)
    if q.device.type == "cpu":
        _check_values(q, k_cache, block_table, seq_lens, query_start_loc)
    if resolve_backend(backend, q.device) == "torch":
        return reference.paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                                         scale=scale, k_scale=k_scale, v_scale=v_scale, out=out)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    return _launch_paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
                                   k_scale, v_scale, num_splits, out)
