"""kernels.linear: which operands take skinny_gemm (inside `for_graphs` only), and that its results are
F.linear's to within the error torch's own bf16 product makes (against float64), also replayed from a
CUDA graph captured as the engine's builders capture (eager warm-up, then capture, in the block)."""

import random

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import SKINNY_ROWS, for_graphs, linear, takes_skinny

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_on_cpu_it_is_f_linear_bit_for_bit():
    rng = random.Random()
    lead = (rng.randint(1, 3), rng.randint(1, 9))
    x, weight, bias = torch.randn(*lead, 24), torch.randn(10, 24), torch.randn(10)
    assert not takes_skinny(x, weight)
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
    with for_graphs():
        assert torch.equal(linear(x, weight), F.linear(x, weight))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="skinny_gemm serves Hopper GPUs only")
def test_hopper_takes_skinny_for_few_16_bit_rows_without_bias():
    weight = torch.randn(256, 128, device="cuda").bfloat16()
    few, many = (torch.randn(n, 128, device="cuda").bfloat16() for n in (SKINNY_ROWS, SKINNY_ROWS + 1))
    assert takes_skinny(few, weight)
    assert takes_skinny(few.view(2, SKINNY_ROWS // 2, 128), weight)
    assert not takes_skinny(many, weight)
    assert not takes_skinny(few, weight, torch.zeros(256, device="cuda").bfloat16())
    assert not takes_skinny(few.float(), weight.float())


def captured(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(x, weight) as the engine's graph builders run it: eagerly once, then captured; replayed."""
    with for_graphs():
        eager = linear(x, weight)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = linear(x, weight)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="skinny_gemm serves Hopper GPUs only")
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (4096, 12288), (1000, 320)])
def test_hopper_results_are_as_close_to_float64_as_torch_is(n, k):
    for rows in (1, 7, SKINNY_ROWS):
        x = torch.randn(2, rows, k, device="cuda").bfloat16()[1]  # a view into a larger tensor
        weight = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        exact = x.double() @ weight.double().t()
        torch_error = F.linear(x, weight).double().sub(exact).abs().max().item()
        error = captured(x, weight).double().sub(exact).abs().max().item()
        assert error <= 2 * torch_error + 1e-3, (rows, error, torch_error)
        assert torch.equal(linear(x, weight), F.linear(x, weight))  # outside the block: cuBLAS's own result
