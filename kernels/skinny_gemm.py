"""y = x @ W^T for the few rows of a small-batch step: a weight-streaming GEMM, a candidate for cuBLAS's.

At 16 rows (a B 1 verify) the target's GEMMs read their weights once and do little else, so their
time is the weights' bytes over the bandwidth they reach. On an H100 cuBLAS streams the big ones
near the card's rate (gate/up 2.90 TB/s, lm_head 2.98) but the small ones well below it (q/k/v
2.43, o 2.04; bench/results/small_gemm_h100.md): ~0.45 ms of a B 1 step.

Here each program owns BLOCK_N output columns and, when SPLIT_K > 1, one of SPLIT_K slices of K,
and streams its [BLOCK_N, K / SPLIT_K] slice of W through a pipelined loop of [BLOCK_N, BLOCK_K]
tiles against the rows of x (all of them: M <= MAX_ROWS, padded to the dot's 16). With SWAP_AB the
dot runs as W x^T (the weight tile is the tensor cores' wide operand, the rows the narrow one),
else as x W^T. Split slices store fp32 partials; the last slice of a column tile to finish (an
arrival counter, `split_kv.arrive_last`) sums them and writes y: one launch, no memset, no cast.
With PDL (Hopper) a launch overlaps the tail of the kernel before it.

`bench.bench_small_gemm` times it beside cuBLAS over `CANDIDATES` per shape, and `rule_tiles`'
choice beside both; `kernels.linear` takes it where that measured faster.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl, split_kv

MAX_ROWS = 64


class SkinnyTiles(NamedTuple):
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_stages: int = 4
    num_warps: int = 4
    swap_ab: bool = True


DEFAULT_TILES = SkinnyTiles()
# What the bench sweeps per shape on a GPU: column tiles of one warpgroup's wgmma height or half it,
# splits that give the small weights (N 4096) enough programs to fill an H100/H200, both dot orders.
CANDIDATES = tuple(SkinnyTiles(n, k, s, st, 4, swap) for swap in (True, False) for n in (32, 64, 128)
                   for k in (128, 256) for s in (1, 2, 4) for st in (3, 5)
                   if not (swap and n == 32))


def rule_tiles(n: int, k: int, device: torch.device) -> SkinnyTiles:
    """The launch shape for an [N, K] weight, drawn from the H100 sweep of the 8B target's GEMMs at 1 and
    16 rows (bench/results/small_gemm_h100_skinny.md), where 64-column tiles on the swapped dot won 8
    of the 10 cells: those tiles, 256-wide K tiles in 4 stages, and two K slices for a weight whose
    column tiles would leave over half the SMs idle (o and down: 64 tiles on 132 SMs). On an H200 at
    16 rows it came within 3% of the sweep's best on every GEMM (bench/results/skinny_gemm_h200.md)."""
    column_tiles = triton.cdiv(n, DEFAULT_TILES.block_n)
    split = 2 if 2 * column_tiles <= split_kv.num_sms(device) and k >= 4 * DEFAULT_TILES.block_k else 1
    return DEFAULT_TILES._replace(split_k=split)


# The row count changes from call to call within one weight's calls (a prefill chunk of 1..16 tokens,
# a decode of 1..16 sequences): Triton would compile a kernel for 1, for multiples of 16 and for the
# rest. The tiles already cover 16 rows; nothing is gained by specialising.
@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, counters, num_rows, n, k, stride_xm, stride_wn,
                        stride_ym, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, SWAP_AB: tl.constexpr,
                        USE_PDL: tl.constexpr, PRECISION: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    col_ok, row_ok = cols < n, rows < num_rows
    slice_len = tl.cdiv(tl.cdiv(k, SPLIT_K), BLOCK_K) * BLOCK_K
    lo = pid_k * slice_len
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    else:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    pdl.wait_for_previous_grid(USE_PDL)
    for start in tl.range(lo, tl.minimum(lo + slice_len, k), BLOCK_K, num_stages=NUM_STAGES):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    pdl.allow_next_grid(USE_PDL)
    if SWAP_AB:
        acc = tl.trans(acc)
    mask = row_ok[:, None] & col_ok[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # partials [SPLIT_K, num_rows, n] fp32; the column tile's last slice sums them in slice order
        part = part_ptr + rows[:, None] * n + cols[None, :]
        tl.store(part + pid_k * num_rows * n, acc, mask=mask)
        if split_kv.arrive_last(counters + pid_n, SPLIT_K):
            total = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part + s * num_rows * n, mask=mask, other=0.0)
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, tiles: SkinnyTiles | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, for M <= MAX_ROWS (fp32 in full precision,
    not TF32).

    Parameters
    ----------
    x : Tensor [M, K], unit stride on K
    weight : Tensor [N, K], unit stride on K, x's dtype
    tiles : SkinnyTiles, the launch shape (block sizes, K split, pipeline stages, warps, dot order);
        None: `rule_tiles`'s
    out : optional Tensor [M, N] in x's dtype with unit column stride, written in place
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1..{MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError("x and weight need a unit stride on K and one dtype")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} and weight on {weight.device}")
    (num_rows, k), n = x.shape, weight.shape[0]
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    elif out.shape != (num_rows, n) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out must be {x.dtype} [{num_rows}, {n}] with unit column stride on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    tiles = tiles or rule_tiles(n, k, x.device)
    rows = max(16, triton.next_power_of_2(num_rows))
    grid = (triton.cdiv(n, tiles.block_n), tiles.split_k)
    if tiles.split_k > 1:
        partials = torch.empty((tiles.split_k, num_rows, n), dtype=torch.float32, device=x.device)
        counters = split_kv.arrival_counters(grid[0], x.device)
    else:
        partials = counters = out  # unread
    use_pdl = pdl.use_pdl(x.device)
    _skinny_gemm_kernel[grid](x, weight, out, partials, counters, num_rows, n, k, x.stride(0),
                              weight.stride(0), out.stride(0), ROWS=rows, BLOCK_N=tiles.block_n,
                              BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k, NUM_STAGES=tiles.num_stages,
                              SWAP_AB=tiles.swap_ab, USE_PDL=use_pdl,
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                              num_warps=tiles.num_warps, launch_pdl=use_pdl)
    return out
