"""y = x @ W^T for the few rows of a small-batch step: a weight-streaming GEMM, a candidate for cuBLAS's.

At 16 rows (a B 1 verify) the target's GEMMs read their weights once and do little else, so their
time is the weights' bytes over the bandwidth they reach. On an H100 cuBLAS streams the big ones
near the card's rate (gate/up 2.90 TB/s, lm_head 2.98) but the small ones well below it (q/k/v
2.43, o 2.04; bench/results/small_gemm_h100.md): ~0.45 ms of a B 1 step. Here each program owns
BLOCK_N output columns and, when SPLIT_K > 1, one of SPLIT_K slices of K, and streams its
[BLOCK_N, K / SPLIT_K] slice of W through a pipelined loop of [BLOCK_N, BLOCK_K] tiles against the
rows of x (all of them: M <= MAX_ROWS, padded to the dot's 16); slices add into an fp32 output
with atomics, cast once at the end (a second, tiny launch). `bench.bench_small_gemm` times it
beside cuBLAS over a few (BLOCK_N, BLOCK_K, SPLIT_K, stages) per shape; it is not wired into the
model until it wins there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 64


class SkinnyTiles(NamedTuple):
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_stages: int = 4
    num_warps: int = 4


DEFAULT_TILES = SkinnyTiles()
# What the bench sweeps per shape on a GPU.
CANDIDATES = tuple(SkinnyTiles(n, k, s, st) for n in (32, 64, 128) for k in (128, 256) for s in (1, 2, 4)
                   for st in (3, 5))


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, num_rows, n, k, stride_xm, stride_wn, stride_ym,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    col_ok, row_ok = cols < n, rows < num_rows
    slice_len = tl.cdiv(tl.cdiv(k, SPLIT_K), BLOCK_K) * BLOCK_K
    lo = pid_k * slice_len
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for start in tl.range(lo, tl.minimum(lo + slice_len, k), BLOCK_K, num_stages=NUM_STAGES):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, tiles: SkinnyTiles = DEFAULT_TILES) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, for M <= MAX_ROWS.

    Parameters
    ----------
    x : Tensor [M, K], unit stride on K
    weight : Tensor [N, K], unit stride on K, x's dtype
    tiles : SkinnyTiles, the launch shape (block sizes, K split, pipeline stages, warps)
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1..{MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError("x and weight need a unit stride on K and one dtype")
    (num_rows, k), n = x.shape, weight.shape[0]
    rows = max(16, triton.next_power_of_2(num_rows))
    split = tiles.split_k > 1
    y = torch.zeros((num_rows, n), dtype=torch.float32, device=x.device) if split else \
        torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, tiles.block_n), tiles.split_k)
    _skinny_gemm_kernel[grid](x, weight, y, num_rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
                              ROWS=rows, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k,
                              NUM_STAGES=tiles.num_stages, num_warps=tiles.num_warps)
    return y.to(x.dtype) if split else y
