"""The models' projections: cuBLAS's `F.linear`, or `kernels.skinny_gemm` for the few rows of a small step.

Why: a B 1 step's GEMMs read their weights once for 1-16 rows, and on an H100 cuBLAS streams the
smaller ones well below the card's bandwidth. `skinny_gemm` under `rule_tiles` measured faster
for every GEMM of the 8B target at 1 and 16 rows (bench/results/small_gemm_h100_skinny.md), so it
serves 16-bit projections without a bias at up to SKINNY_ROWS rows on Hopper GPUs, where it was
measured; everything else (other GPUs, CPU, prefill chunks, batches, fp32, biases) stays on
`F.linear`. The choice depends on shapes and dtypes only, so a captured CUDA graph keeps it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import operands
from kernels.skinny_gemm import skinny_gemm

SKINNY_ROWS = 16
SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def takes_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` runs `skinny_gemm` for these operands."""
    if bias is not None or not x.is_cuda or x.dtype not in SKINNY_DTYPES or weight.dtype != x.dtype:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return (1 <= rows <= SKINNY_ROWS and weight.dim() == 2 and weight.stride(1) == 1
            and operands.is_hopper(x.device))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [..., K], weight [N, K] -> [..., N]."""
    if not takes_skinny(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return skinny_gemm(rows, weight).view(*x.shape[:-1], weight.shape[0])
