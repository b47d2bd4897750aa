"""kernels.operands: the MMA dtype rule and the power-of-two shift that narrows q to fp16's range."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from kernels import operands

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@triton.jit
def _shift_probe(q_ptr, out_ptr, shift_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    q, shift = operands.fp16_range_shift(tl.load(q_ptr + offs))
    tl.store(out_ptr + offs, q)
    tl.store(shift_ptr, shift)


@pytest.mark.parametrize("amax", [0.5, 1e3, 32768.0, 40000.0, 3e5, 1e9])
def test_shift_brings_the_largest_value_into_range_by_a_power_of_two(amax):
    q = torch.randn(16, 32, device=DEVICE)
    q = q / q.abs().max() * amax
    out, shift = torch.empty_like(q), torch.empty(1, device=DEVICE)
    _shift_probe[(1,)](q, out, shift, ROWS=16, COLS=32)
    expected = max(0, math.ceil(math.log2(max(amax, 1.0) / 32768.0)))
    assert shift.item() == expected
    torch.testing.assert_close(out, q * 2.0**-expected, rtol=0, atol=0)  # exact: a power of two
    assert out.abs().max().item() <= 32768.0
    assert torch.isfinite(out.half()).all()


def test_mma_dtype_rule():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert operands.mma_dtype(torch.bfloat16, FP8, cpu) == torch.float32  # the interpreter
    assert operands.mma_dtype(torch.bfloat16, torch.bfloat16, cuda) == torch.bfloat16
    assert operands.mma_dtype(torch.bfloat16, FP8, cuda) == torch.float16
    assert operands.mma_dtype(torch.float16, FP8, cuda) == torch.float16
    assert operands.narrows_q(torch.float16, torch.bfloat16)
    assert not operands.narrows_q(torch.float16, torch.float16)
    assert not operands.narrows_q(torch.bfloat16, torch.bfloat16)


@triton.jit
def _widen_probe(x_ptr, out_ptr, CVT_ASM: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(out_ptr + offs, operands.widen_values(tl.load(x_ptr + offs), tl.float16, CVT_ASM))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_inline_asm_widening_matches_torch_on_every_e4m3_value():
    # every byte pattern but the two NaNs, in a shuffled 64 x 64 tile: exact, as torch widens them
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    tile = codes[torch.randint(0, codes.numel(), (64 * 64,))].view(torch.float8_e4m3fn).cuda()
    expected = tile.to(torch.float16)
    for cvt_asm in (operands.fp8_cvt_asm(tile.device), False):
        out = torch.empty(64 * 64, dtype=torch.float16, device="cuda")
        _widen_probe[(1,)](tile, out, CVT_ASM=cvt_asm, N=64)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_e4m3_scores_only_for_fp8_caches_in_hopper_mma_tiles(monkeypatch):
    # smaller tiles (mma.sync) would widen both e4m3 operands to fp16 again: no gain, q's terms lost
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(operands, "_is_hopper", lambda index: True)
    assert operands.quantizes_q(FP8, cuda, 64, 128) and operands.quantizes_q(FP8, cuda, 256, 64)
    assert not operands.quantizes_q(FP8, cuda, 32, 128)
    assert not operands.quantizes_q(FP8, cuda, 64, 16)  # the e4m3 MMA reduces 32 at a time
    assert not operands.quantizes_q(torch.bfloat16, cuda, 64, 128)
    assert not operands.quantizes_q(FP8, cpu, 64, 128)  # the interpreter has no e4m3 math
    monkeypatch.setattr(operands, "_is_hopper", lambda index: False)
    assert not operands.quantizes_q(FP8, cuda, 64, 128)  # other GPUs keep the fp16 score dot


@triton.jit
def _quantize_probe(q_ptr, hi_ptr, lo_ptr, s_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    hi, lo, s = operands.quantize_rows_e4m3(tl.load(q_ptr + offs))
    # widened before the store: Triton 3.6 stored this lo tile as e4m3 with half its elements wrong on
    # an H200 (the kernels feed it to the MMA from registers, where the attention tests check it)
    tl.store(hi_ptr + offs, hi.to(tl.float32))
    tl.store(lo_ptr + offs, lo.to(tl.float32))
    tl.store(s_ptr + tl.arange(0, ROWS), s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_two_e4m3_terms_hold_q_to_an_eighth_bit():
    # rows of very different scales, one all zero: s = amax / 448 per row, and s * (hi + lo) within
    # 2**-8 of each element plus e4m3's subnormal step (2**-10 of s) of q, in float64
    q = torch.randn(64, 128, dtype=torch.float64) * torch.logspace(-6, 6, 64, dtype=torch.float64)[:, None]
    q[5] = 0.0
    q = q.float().cuda()
    hi, lo = torch.empty_like(q), torch.empty_like(q)
    s = torch.empty(64, device="cuda")
    _quantize_probe[(1,)](q, hi, lo, s, ROWS=64, COLS=128)
    amax = q.abs().amax(1)
    torch.testing.assert_close(s, torch.where(amax > 0, amax / 448, 1.0), rtol=1e-6, atol=0)
    q64, s64 = q.double(), s.double()[:, None]
    assert torch.equal(hi.to(FP8).float(), hi) and torch.equal(lo.to(FP8).float(), lo)  # e4m3 values
    err = (s64 * (hi.double() + lo.double()) - q64).abs()
    assert (err <= s64 * (q64.abs() / s64 * 2**-8 + 2**-10) * (1 + 1e-6)).all()
    one_term = (s64 * hi.double() - q64).abs()
    assert err.sum() < one_term.sum() / 8  # the second term is what buys the precision
