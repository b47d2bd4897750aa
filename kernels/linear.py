"""The models' projections: cuBLAS's `F.linear`, or `kernels.skinny_gemm` for the few rows of a small step.

Why: a B 1 step's GEMMs read their weights once for 1-16 rows, and on an H100 cuBLAS streams the
smaller ones well below the card's bandwidth. `skinny_gemm`'s launch shapes measured faster for
every GEMM of the 8B target at 1 and 16 rows on an H100 (bench/results/small_gemm_h100_skinny.md);
under `rule_tiles` on an H200 it took 0.81-0.99 of F.linear's time at 16 rows, and the B 1 step from
CUDA graphs 0.94 (plain) and 0.96 (DFlash) of its time (bench/results/skinny_gemm_h200.md). The
same steps run eagerly took 1.13-1.15 of their time: a Triton launch costs more host time than a
cuBLAS call, and an eager B 1 step is bound by its ~250 launches. So skinny_gemm serves 16-bit
projections without a bias at up to SKINNY_ROWS rows on Hopper GPUs (where it was measured) inside
`for_graphs()`, which the CUDA-graph builders hold around each shape's eager warm-up and capture (the
warm-up loads the kernel: a first launch inside a capture would fail); everything else (eager steps,
other GPUs, CPU, prefill chunks, batches, fp32, biases) stays on `F.linear`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kernels import operands
from kernels.skinny_gemm import skinny_gemm

SKINNY_ROWS = 16
SKINNY_DTYPES = (torch.bfloat16, torch.float16)

_graph_building = threading.local()  # per thread: a builder's block does not reach another thread's steps


@contextlib.contextmanager
def for_graphs() -> Iterator[None]:
    """Projections in this block (this thread) are the ones a CUDA graph will replay: they may take
    `skinny_gemm`."""
    depth = getattr(_graph_building, "depth", 0)
    _graph_building.depth = depth + 1
    try:
        yield
    finally:
        _graph_building.depth = depth


def takes_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` runs `skinny_gemm` for these operands inside `for_graphs()`."""
    if bias is not None or not x.is_cuda or x.dtype not in SKINNY_DTYPES or weight.dtype != x.dtype:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return (1 <= rows <= SKINNY_ROWS and weight.dim() == 2 and weight.stride(1) == 1
            and operands.is_hopper(x.device))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [..., K], weight [N, K] -> [..., N]."""
    if not (getattr(_graph_building, "depth", 0) and takes_skinny(x, weight, bias)):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return skinny_gemm(rows, weight).view(*x.shape[:-1], weight.shape[0])
