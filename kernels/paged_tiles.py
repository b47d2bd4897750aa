"""Launch shapes of the paged attention kernel, from static shapes and dtypes only.

`choose_tiles` picks the tile of a regime (decode, verify, prefill) and operand width; the split
plan (`split_plan`) decides from the work-item count how many ways a small batch splits its keys;
then rules measured on an H200 refine the tile (`with_key_lanes`, `with_double_buffering`).
`default_plan` chains them for `kernels.paged_attention`, and `default_tiles` is its tile, what
the benches time. Nothing here reads a length or syncs the device, so a captured CUDA graph holds
for any lengths.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from kernels import split_kv
from kernels.validation import FP8

# Query rows (positions x group heads) per tile when the batch is mostly prefill: the tensor-core
# tile that keeps a long chunk compute bound (256 rows x 64 keys in 3 stages: 9% faster than 128 x 128
# for a bf16 and for an fp8 cache on an H200, kernel_variants_2_tiles (git history) and
# _3_stages); half of it where 32-bit operands or D > 128 would overflow shared memory and in the
# interpreter; FP8_PREFILL_ROWS over an fp8 cache (see GPU_TILES).
PREFILL_ROWS = 256
FP8_PREFILL_ROWS = 64
# Mean queries per sequence above which a batch is treated as prefill-heavy.
MAX_VERIFY_QUERIES = 16
MAX_KEY_TILE_BYTES = 32 << 10
# Pipeline stages at which Triton double-buffers the K/V tiles of decode-size tiles behind their page-id
# loads (`with_double_buffering`; the context kernel's 16-bit tiles take them too), and the most
# splits per work item for which they pay.
DOUBLE_BUFFER_STAGES = 5
FEW_SPLITS = 4
# The head dims they were measured at (D 128); wider heads keep the tiles they took before.
DOUBLE_BUFFER_MAX_HEAD_DIM = 128


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
# H200 sweeps recorded in paged_attention_sweep (git history) and kernel_variants_*
# (Qwen3-8B
# geometry, D 128). bf16 verify tiles of at most 32 rows take 128 keys instead (q_len 8: 16% faster).
# 32-bit operands keep at most 2 stages (shared memory).
# An fp8 prefill takes the fp8 verify tile: FP8_PREFILL_ROWS (64) x 128 keys on one warpgroup in 2
# stages, two programs per SM (their dots and softmax need not run in step): 4% faster than 128 x 128
# on 8 warps in 5 stages (1514.5 -> 1450.1 us for the 8k prefill; 3 stages 1450.3; 64 keys 17%
# slower; the same 64-row tiles 33-72% slower for a bf16 cache: kernel_variants_24_prefill_64_rows),
# which was 5% faster than 256 x 64 in 3 stages (kernel_variants_19_prefill_stages (git history)). Above
# DOUBLE_BUFFER_MAX_HEAD_DIM it takes the 16-bit prefill tile on half the rows, as before.
GPU_TILES = {
    ("decode", 2): (128, 4, 3), ("verify", 2): (64, 4, 3), ("prefill", 2): (64, 8, 3),
    ("decode", 1): (128, 4, 2), ("verify", 1): (128, 4, 2), ("prefill", 1): (128, 4, 2),
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
        if wide_operands or head_dim > DOUBLE_BUFFER_MAX_HEAD_DIM or not on_gpu:
            rows = PREFILL_ROWS // 2
        else:
            rows = FP8_PREFILL_ROWS if cache_dtype.itemsize == 1 else PREFILL_ROWS
        block_q = max(1, rows // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    if not on_gpu:
        # The interpreter: small key tiles so tests cross tiles and pages at tiny lengths.
        return TileConfig(block_q, block_m, 16, 4, 1)
    block_n, num_warps, num_stages = GPU_TILES[regime, min(2, cache_dtype.itemsize)]
    if regime == "prefill" and head_dim > DOUBLE_BUFFER_MAX_HEAD_DIM:  # the fp8 tile: measured at D 128
        block_n, num_warps, num_stages = GPU_TILES["prefill", 2]
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
    kernel_variants_13_key_lanes_default in git history). Not where a program walks few
    tiles (B 1,
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
    loads start after this tile's dots), 5 give two. Side by side (kernel_variants_15_stages to
    _18_stages, in git history): fp8 decode with key lanes 4-15% faster (B 32 ctx 32768: 76% -> 89%
    of copy), split fp8 decode at B 8 2-14%, fp8 q_len 8 (32 rows) 5-9%;
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
    return default_plan(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, device, cache_dtype,
                         q_dtype, num_splits)[0]


def default_plan(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, device, cache_dtype, q_dtype,
                 num_splits) -> tuple[TileConfig, int, int]:
    """(tiles, max_splits, min_tokens_per_split) of a call that leaves the tiles to the launcher.

    Key lanes and stages change none of the tile sizes the split plan reads, so the plan holds after
    them."""
    tiles = choose_tiles(num_tokens, num_seqs, num_heads // num_kv_heads, head_dim, device, cache_dtype,
                         q_dtype)
    num_items = work_items(num_tokens, num_seqs, num_kv_heads, tiles)
    max_splits, min_tokens = split_plan(num_items, num_heads, head_dim, tiles, num_splits, device)
    tiles = with_key_lanes(tiles, cache_dtype, max_splits > 1, device)
    return (with_double_buffering(tiles, cache_dtype, head_dim, num_items, max_splits, device), max_splits,
            min_tokens)


def work_items(num_tokens: int, num_seqs: int, num_kv_heads: int, tiles: TileConfig) -> int:
    """Programs of a one-split grid that have work: query tiles (at least one per sequence) x KV heads."""
    return max(num_seqs, triton.cdiv(num_tokens, tiles.block_q)) * num_kv_heads


def split_plan(num_items: int, num_heads: int, head_dim: int, tiles: TileConfig, num_splits: int | None,
               device: torch.device) -> tuple[int, int]:
    """(max_splits, min_tokens_per_split) for the grid of `num_items` work items (`work_items`); 1 split
    means no partials and no merge."""
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


def check_tiles(tiles: TileConfig) -> None:
    """A caller's launch shape (benches, tests): what the kernel's tiles need, as a clear error."""
    lanes = tiles.key_lanes
    if lanes < 1 or lanes & (lanes - 1) or tiles.block_n % lanes or tiles.block_n // lanes < 16:
        raise ValueError(f"key_lanes must be a power of two leaving >= 16 keys of the {tiles.block_n}-key "
                         f"tile per lane, got {lanes}")
    if lanes > 1 and tiles.block_m > 32:
        raise ValueError(f"key_lanes > 1 is for tiles of <= 32 rows, got {tiles.block_m} rows")
