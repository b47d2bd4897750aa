"""Target causal attention over paged K/V: one kernel for prefill chunks, verify blocks and decode.

`paged_attention` validates, picks the tiles and the split plan from shapes alone (no device sync,
so a CUDA graph captures it), launches `kernels.paged_attention_kernel` and, when the keys were
split, the shared merge of `kernels.split_kv`. The torch oracle with the same signature is
`kernels.reference.paged_attention`; backend "auto" runs it on CPU tensors.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import triton

from kernels import operands, pdl, reference, split_kv
from kernels.dispatch import resolve_backend
from kernels.paged_attention_kernel import _paged_attention_kernel, launch_grid
from kernels.validation import FP8

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (*Q_DTYPES, torch.float8_e4m3fn)
MAX_HEAD_DIM = 256
# Query rows (positions x group heads) per tile when the batch is mostly prefill: the tensor-core
# tile that keeps a long chunk compute bound (256 rows x 64 keys in 3 stages: 9% faster than 128 x 128
# for a bf16 and for an fp8 cache on an H200, bench/results/kernel_variants_2_tiles.md and
# _3_stages.md); half of it where 32-bit operands or D > 128 would overflow shared memory, in the
# interpreter, and over an fp8 cache (128 x 128 in 5 stages, see GPU_TILES).
PREFILL_ROWS = 256
# Mean queries per sequence above which a batch is treated as prefill-heavy.
MAX_VERIFY_QUERIES = 16
MAX_KEY_TILE_BYTES = 32 << 10
# The last split of a (query tile, KV head) to finish merges the partials itself, with no merge
# kernel, for verify blocks split at most this many ways: measured 5-10% faster at B 8-16, q_len 8
# on an H200 (bench/results/latency_ablation.md). Decode, whose merge kernel is small, and deeper
# splits, whose merge steps run one after another in that one program, keep the merge kernel.
FUSED_MERGE_MAX_SPLITS = 4
# query_start_loc entries one program loads at once to find its sequence in verify and prefill
# batches: one round trip for B < 64 where a binary search waits log2(B) dependent loads. Measured
# on an H200 (bench/results/latency_ablation.md): bf16 verify 1-4% faster; pure decode batches
# were up to 5% slower with it (fp8, B >= 32), so they keep the binary search. 1 turns it off.
SEQ_SEARCH = 64
# Pipeline stages at which Triton double-buffers the K/V tiles of decode-size tiles behind their page-id
# loads, and the most splits per work item for which they pay (`with_double_buffering`).
DOUBLE_BUFFER_STAGES = 5
FEW_SPLITS = 4
# The head dims they were measured at (D 128); wider heads keep at most 3 stages (shared memory).
DOUBLE_BUFFER_MAX_HEAD_DIM = 128
# fp32 elements of partial state one fused-merge step holds per thread (register budget).
FUSED_MERGE_ELEMENTS_PER_THREAD = 64



class TileConfig(NamedTuple):
    """Launch shape of one call: BLOCK_Q query positions x GROUP heads in BLOCK_M rows, BLOCK_N keys.

    key_lanes > 1 deals each key tile to that many softmax states per row (one per warp, merged at
    the end), so row reductions stay inside warps (`paged_attention_kernel._attend_key_tile_lanes`):
    for tiles of <= 32 rows, with fewer CTA barriers per key tile. Defaults use it where it measured
    faster (`with_key_lanes`).
    """

    block_q: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    key_lanes: int = 1


# (block_n, num_warps, num_stages) per regime and cache element size on a GPU: the winners of the
# H200 sweeps recorded in bench/results/paged_attention_sweep.md and kernel_variants_*.md (Qwen3-8B
# geometry, D 128). bf16 verify tiles of at most 32 rows take 128 keys instead (q_len 8: 16% faster).
# 32-bit operands keep at most 2 stages (shared memory).
# An fp8 prefill takes half the rows (PREFILL_ROWS // 2) x 128 keys in 5 stages, where Triton gives
# its V two buffers (one at 3, an offline sm_90 build): 5% faster than 256 x 64 in 3 stages
# (1587.7 -> 1506.0 us for the 8k prefill; 256 x 64 in 5 stages 2.4%, the bf16 tile at 5 stages 0%:
# bench/results/kernel_variants_19_prefill_stages.md). Above DOUBLE_BUFFER_MAX_HEAD_DIM it takes the
# 16-bit prefill tile, as before.
GPU_TILES = {
    ("decode", 2): (128, 4, 3), ("verify", 2): (64, 4, 3), ("prefill", 2): (64, 8, 3),
    ("decode", 1): (128, 4, 2), ("verify", 1): (128, 4, 2), ("prefill", 1): (128, 8, 5),
}


def choose_tiles(num_tokens: int, num_seqs: int, group: int, head_dim: int, device: torch.device,
                 cache_dtype: torch.dtype = torch.bfloat16, q_dtype: torch.dtype = torch.bfloat16
                 ) -> TileConfig:
    """Tiles from static shapes only (T and B are fixed for a captured batch), never from lengths.

    A mean of <= 16 queries per sequence (decode, verify, or a mix) gets the smallest tile that
    holds one sequence's queries x group; anything longer gets PREFILL_ROWS-row tiles. A mixed
    batch then pays idle rows for its decodes, not extra K/V bytes.
    """
    on_gpu = device.type == "cuda"
    wide_operands = max(cache_dtype.itemsize, q_dtype.itemsize) > 2  # 32-bit: shared memory runs short
    mean_q = triton.cdiv(num_tokens, max(num_seqs, 1))
    if mean_q <= MAX_VERIFY_QUERIES:
        regime = "decode" if mean_q == 1 else "verify"
        block_q = max(triton.next_power_of_2(mean_q), 16 // group if group < 16 else 1)
    else:
        regime = "prefill"
        half = wide_operands or head_dim > 128 or not on_gpu or cache_dtype.itemsize == 1
        rows = PREFILL_ROWS // 2 if half else PREFILL_ROWS
        block_q = max(1, rows // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    if not on_gpu:
        # The interpreter: small key tiles so tests cross tiles and pages at tiny lengths.
        return TileConfig(block_q, block_m, 16, 4, 1)
    block_n, num_warps, num_stages = GPU_TILES[regime, min(2, cache_dtype.itemsize)]
    if regime == "prefill" and head_dim > DOUBLE_BUFFER_MAX_HEAD_DIM:  # fp8's 128 x 128 tile: measured at
        block_n, num_warps, num_stages = GPU_TILES["prefill", 2]  # D 128, 225 KiB of shared memory at D 256
    if regime == "verify" and cache_dtype.itemsize == 2 and block_m <= 32:
        block_n = 128
    # The sweep's tiles hold <= 32 KiB of K per stage (bf16, D 128): wider keys (fp32, D 256) get
    # fewer of them so the pipelined stages still fit in shared memory.
    while block_n > 16 and block_n * head_dim * cache_dtype.itemsize > MAX_KEY_TILE_BYTES:
        block_n //= 2
    if wide_operands:
        num_stages = min(num_stages, 2)
    return TileConfig(block_q, block_m, block_n, num_warps, num_stages)


def with_key_lanes(tiles: TileConfig, cache_dtype: torch.dtype, split: bool,
                   device: torch.device) -> TileConfig:
    """Chosen tiles with key lanes where they measured faster on an H200: fp8 tiles of <= 16 rows
    (decode, or verify of q_len x group <= 16) that walk whole contexts (no split) take 4 lanes of
    32 keys: 5-9% faster at B 32-128, ctx >= 8192, 1-3% slower at ctx 2048 (3 stages each,
    bench/results/kernel_variants_13_key_lanes_default.md). Not where a program walks few tiles (B 1,
    split: 1.33x slower; B 32 ctx 2048: 1.03x), with 32-row tiles (q_len 8: 1.32x) or over bf16
    caches (1.01-1.07x). The stages are `with_double_buffering`'s."""
    if (device.type == "cuda" and cache_dtype == FP8 and not split and tiles.block_m <= 16
            and tiles.block_n == 128 and tiles.key_lanes == 1):
        return tiles._replace(key_lanes=4)
    return tiles


def with_double_buffering(tiles: TileConfig, cache_dtype: torch.dtype, head_dim: int, num_items: int,
                          max_splits: int, device: torch.device) -> TileConfig:
    """Chosen tiles with DOUBLE_BUFFER_STAGES where that measured faster on an H200.

    Triton's pipeliner spends stages on the page-id loads that the K/V addresses wait for: in an
    offline sm_90 build of these tiles, 3 or 4 stages keep ONE K and V buffer (the next tile's
    loads start after this tile's dots), 5 give two. Side by side (bench/results/
    kernel_variants_15_stages.md to _18_stages.md): fp8 decode with key lanes 4-15% faster (B 32
    ctx 32768: 76% -> 89% of copy), split fp8 decode at B 8 2-14%, fp8 q_len 8 (32 rows) 5-9%;
    bf16 q_len 16 (64 x 64 tiles, one program per SM at 5 stages where two fit at 3) 4-10% for up
    to WAVES programs per SM (B 32 ctx 32768: 85% -> 93-95%; B 8 5-20% against the previous run),
    but from -3.5% to +6% at B 128-256, so those keep 3. Not taken: programs of many splits (B 1,
    33 splits: fp8 decode 4-8% slower at ctx <= 8192, 12% faster at 32768, q_len 8 13% slower: each
    walks few tiles), bf16 decode and q_len 8 (12-32% slower: one program per SM where three fit),
    fp8 q_len 16 (21-30%, its K/V already double-buffered) and 7 stages (5-18%, three buffers).
    """
    if device.type != "cuda" or max_splits > FEW_SPLITS or head_dim > DOUBLE_BUFFER_MAX_HEAD_DIM:
        return tiles
    fp8_small = cache_dtype == FP8 and tiles.block_m <= 32 and tiles.block_n == 128
    bf16_verify = (cache_dtype.itemsize == 2 and tiles.block_m == 64 and tiles.block_n == 64
                   and num_items <= split_kv.WAVES * split_kv.num_sms(device))
    if fp8_small or bf16_verify:
        return tiles._replace(num_stages=DOUBLE_BUFFER_STAGES)
    return tiles


def default_tiles(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  device: torch.device, cache_dtype: torch.dtype = torch.bfloat16,
                  q_dtype: torch.dtype = torch.bfloat16, num_splits: int | None = None) -> TileConfig:
    """The launch shape `paged_attention` takes for these static shapes: `choose_tiles`, then key
    lanes where the split plan leaves whole contexts to each program and double-buffered stages where
    it leaves few splits (benches time this one)."""
    return _default_plan(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, device, cache_dtype,
                         q_dtype, num_splits)[0]


def _default_plan(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, device, cache_dtype, q_dtype,
                  num_splits) -> tuple[TileConfig, int, int]:
    """(tiles, max_splits, min_tokens_per_split) of a call that leaves the tiles to the launcher.

    Key lanes and stages change none of the tile sizes the split plan reads, so the plan holds after
    them."""
    tiles = choose_tiles(num_tokens, num_seqs, num_heads // num_kv_heads, head_dim, device, cache_dtype,
                         q_dtype)
    max_splits, min_tokens = _split_plan(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, tiles,
                                         num_splits, device)
    tiles = with_key_lanes(tiles, cache_dtype, max_splits > 1, device)
    num_items = _work_items(num_tokens, num_seqs, num_kv_heads, tiles)
    return (with_double_buffering(tiles, cache_dtype, head_dim, num_items, max_splits, device), max_splits,
            min_tokens)


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


def _work_items(num_tokens: int, num_seqs: int, num_kv_heads: int, tiles: TileConfig) -> int:
    """Programs of a one-split grid that have work: query tiles (at least one per sequence) x KV heads."""
    return max(num_seqs, triton.cdiv(num_tokens, tiles.block_q)) * num_kv_heads


def _split_plan(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, tiles, num_splits,
                device) -> tuple[int, int]:
    """(max_splits, min_tokens_per_split) for the grid; 1 split means no partials and no merge.

    The work items are `_work_items`: query tiles (at least one per sequence) x KV heads.
    """
    num_items = _work_items(num_tokens, num_seqs, num_kv_heads, tiles)
    mergeable = (num_heads % 16 == 0 or num_heads & (num_heads - 1) == 0) and (
        head_dim >= 16 and head_dim & (head_dim - 1) == 0)
    if not mergeable:
        if num_splits not in (None, 1):
            raise ValueError(f"split-KV needs NH a multiple of 16 or a power of two and D a power of two "
                             f">= 16 (the shared merge), got NH={num_heads}, D={head_dim}")
        return 1, tiles.block_n
    max_splits = split_kv.plan_max_splits(num_items, device, num_splits)
    # Forced splits (tests, tuning) may be as short as one key tile; planned ones keep the floor.
    floor = tiles.block_n if num_splits is not None else split_kv.min_tokens_per_split(tiles.block_m)
    return max_splits, floor


def _check_tiles(tiles: TileConfig) -> None:
    """A caller's launch shape (benches, tests): what the kernel's tiles need, as a clear error."""
    lanes = tiles.key_lanes
    if lanes < 1 or lanes & (lanes - 1) or tiles.block_n % lanes or tiles.block_n // lanes < 16:
        raise ValueError(f"key_lanes must be a power of two leaving >= 16 keys of the {tiles.block_n}-key "
                         f"tile per lane, got {lanes}")
    if lanes > 1 and tiles.block_m > 32:
        raise ValueError(f"key_lanes > 1 is for tiles of <= 32 rows, got {tiles.block_m} rows")


def _fused_merge_chunk(tiles: TileConfig, d_pad: int) -> int:
    """Splits one fused-merge step loads: a [BLOCK_M, chunk, D] fp32 block within the register budget."""
    elements = FUSED_MERGE_ELEMENTS_PER_THREAD * 32 * tiles.num_warps
    chunk = 2
    while chunk < 16 and tiles.block_m * 2 * chunk * d_pad <= elements:
        chunk *= 2
    return chunk


def _launch_paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, k_scale,
                            v_scale, num_splits, out, tiles: TileConfig | None = None):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    if tiles is None:
        tiles, max_splits, min_tokens = _default_plan(num_tokens, batch, num_heads, num_kv_heads, head_dim,
                                                      q.device, k_cache.dtype, q.dtype, num_splits)
    else:
        _check_tiles(tiles)
        max_splits, min_tokens = _split_plan(num_tokens, batch, num_heads, num_kv_heads, head_dim, tiles,
                                             num_splits, q.device)
    split = max_splits > 1
    grid = launch_grid(num_tokens, batch, num_kv_heads, max_splits, tiles.block_q)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    fused = split and num_tokens > batch and max_splits <= FUSED_MERGE_MAX_SPLITS
    merge_chunk = _fused_merge_chunk(tiles, d_pad)
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
        SEQ_SEARCH=SEQ_SEARCH if num_tokens > batch else 1,
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
