"""skinny_gemm (Triton; the interpreter on CPU) against a float64 matmul, over odd shapes and each kind of
launch shape (one slice of K or several summed by the last to arrive; either dot order)."""

import random

import pytest
import torch

from kernels.skinny_gemm import MAX_ROWS, SkinnyTiles, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tiles", [
    SkinnyTiles(32, 32, 1, 1, swap_ab=False), SkinnyTiles(16, 64, 3, 2, swap_ab=False),
    SkinnyTiles(64, 32, 2, 1, swap_ab=True), SkinnyTiles(32, 16, 3, 1, swap_ab=True),
    SkinnyTiles(16, 32, 1, 1, swap_ab=True)])
def test_matches_a_float64_matmul(tiles):
    rng = random.Random()
    for _ in range(3):  # repeated calls: a split's arrival counters must be back at zero after each
        m, n, k = rng.randint(1, 20), rng.randint(1, 150), rng.randint(1, 200)
        x = torch.randn(m, k, device=DEVICE)
        weight = torch.randn(n, k, device=DEVICE)
        expected = (x.double() @ weight.double().t()).float()
        torch.testing.assert_close(skinny_gemm(x, weight, tiles), expected, rtol=1e-4, atol=1e-4 * k**0.5)


def test_strided_rows_of_a_wider_tensor():
    wide = torch.randn(5, 96, device=DEVICE)
    x = wide[:, :80]  # a view: row stride 96
    weight = torch.randn(40, 80, device=DEVICE)
    torch.testing.assert_close(skinny_gemm(x, weight, SkinnyTiles(16, 32, 1, 1)), x @ weight.t(),
                               rtol=1e-4, atol=1e-3)


def test_writes_into_a_given_output_and_leaves_its_other_columns():
    x, weight = torch.randn(3, 48, device=DEVICE), torch.randn(20, 48, device=DEVICE)
    wide = torch.full((3, 30), 7.0, device=DEVICE)
    out = wide[:, 5:25]  # row stride 30
    returned = skinny_gemm(x, weight, SkinnyTiles(16, 16, 2, 1), out=out)
    assert returned.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-4, atol=1e-3)
    assert (wide[:, :5] == 7).all() and (wide[:, 25:] == 7).all()


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and weight \[N, K\]"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows, got {MAX_ROWS + 1}"):
        skinny_gemm(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="one dtype"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8).double())
    with pytest.raises(ValueError, match=r"out must be torch.float32 \[2, 4\]"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8), out=torch.empty(2, 5))


@pytest.mark.gpu
def test_bf16_on_the_gpu_is_as_close_to_fp64_as_torch_is():
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    weight = (torch.randn(4096, 4096, device="cuda") / 64).bfloat16()
    exact = x.double() @ weight.double().t()
    torch_error = (x @ weight.t()).double().sub(exact).abs().max().item()
    for tiles in (SkinnyTiles(), SkinnyTiles(64, 256, 4, 4), SkinnyTiles(32, 128, 2, 3, swap_ab=False)):
        error = skinny_gemm(x, weight, tiles).double().sub(exact).abs().max().item()
        assert error <= 2 * torch_error + 1e-3, (tiles, error, torch_error)
