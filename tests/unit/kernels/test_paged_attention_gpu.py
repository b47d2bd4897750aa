"""kernels.paged_attention compiled on a GPU: realistic sizes, bf16 and fp8, CUDA graphs.

Against the float64 oracle of `paged_cases` (skipped without a CUDA device).
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import assert_close, attention_f64, make_batch, run_kernel

import kernels
from kernels import operands
from kernels.paged_tiles import default_tiles


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_gpu_mixed_batch_bf16(num_splits):
    batch = make_batch([700, 16, 16, 1, 1, 8], [1200, 3000, 17, 5000, 1, 900], 32, 8, 128,
                       dtype=torch.bfloat16, device="cuda")
    assert_close(run_kernel(batch, num_splits=num_splits), attention_f64(**batch), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 8, 16])
def test_gpu_small_batch_long_context_splits(q_len):
    batch = make_batch([q_len] * 2, [9000, 3001], 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert_close(run_kernel(batch), attention_f64(**batch), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_fp8_cache_with_device_scales():
    batch = make_batch([16, 1, 300], [2000, 4000, 100], 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    k_scale, v_scale = torch.tensor(0.05, device="cuda"), torch.tensor(0.02, device="cuda")
    batch["k_cache"] = (batch["k_cache"].float() / k_scale).to(torch.float8_e4m3fn)
    batch["v_cache"] = (batch["v_cache"].float() / v_scale).to(torch.float8_e4m3fn)
    expected = attention_f64(**batch, k_scale=k_scale.item(), v_scale=v_scale.item())
    assert_close(run_kernel(batch, k_scale=k_scale, v_scale=v_scale), expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_fp8_key_lanes_chosen_for_a_batch_that_fills_the_gpu(q_len):
    # 24 sequences x 8 KV heads fill the SMs (no split): fp8 tiles of 16 rows take 4 key lanes;
    # contexts of 1 to 2100 keys end mid-tile and mid-lane
    ctx = [1 + (i * 397) % 2100 for i in range(24)]
    batch = make_batch([q_len] * 24, ctx, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    items = 24 * 8
    assert kernels.split_kv.plan_max_splits(items, torch.device("cuda")) == 1
    tiles = default_tiles(24 * q_len, 24, 32, 8, 128, torch.device("cuda"), torch.float8_e4m3fn)
    assert tiles.key_lanes == 4
    batch["k_cache"] = (batch["k_cache"].float() / 0.5).to(torch.float8_e4m3fn)
    batch["v_cache"] = (batch["v_cache"].float() / 0.25).to(torch.float8_e4m3fn)
    expected = attention_f64(**batch, k_scale=0.5, v_scale=0.25)
    assert_close(run_kernel(batch, k_scale=0.5, v_scale=0.25), expected, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_verify_graph_merging_in_the_last_split_replays_at_new_lengths():
    # B 8 verify blocks split <= 4 ways merge in their last split; each replay leaves the counters
    # at zero for the next (lengths stay within each sequence's pages)
    batch = make_batch([8] * 8, [3000] * 4 + [500] * 4, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(batch["q"])
    kernels.paged_attention(**batch, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_attention(**batch, out=out)
    for lens in ([3008] * 4 + [508] * 4, [9, 3000, 200, 8, 508, 100, 8, 300], [1000] * 4 + [8] * 4):
        batch["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        assert_close(out, attention_f64(**batch), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [1.0, 3e5])
def test_gpu_fp8_cache_with_queries_beyond_fp16_range(q_scale):
    # the fp8 path's fp16 MMAs: q (bf16) is shifted into fp16's range, so even |q| ~ 1e6 stays finite
    batch = make_batch([1, 8, 40], [3000, 700, 90], 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    batch["q"] = (batch["q"].float() * q_scale / batch["q"].float().abs().amax()).bfloat16()
    batch["q"][0, 0, 0] = q_scale  # one huge element, the rest spread below it
    batch["k_cache"] = (batch["k_cache"].float() / 4).to(torch.float8_e4m3fn)
    batch["v_cache"] = (batch["v_cache"].float() / 4).to(torch.float8_e4m3fn)
    expected = attention_f64(**batch, scale=1e-5 if q_scale > 1 else None, k_scale=4.0, v_scale=4.0)
    out = run_kernel(batch, scale=1e-5 if q_scale > 1 else None, k_scale=4.0, v_scale=4.0)
    assert_close(out, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [1.0, 3e5])
def test_gpu_e4m3_scores_keep_the_accuracy_of_fp16_scores(q_scale, monkeypatch):
    # verify blocks of 16 (64-row tiles) and a prefill chunk over an fp8 cache, scored in e4m3 with q
    # in two e4m3 terms: as close to float64 as the fp16 scores (q alone in e4m3 would be ~10x off);
    # the fp16 scores are those a GPU other than Hopper takes, here on this one
    batch = make_batch([16, 16, 300], [3000, 700, 90], 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    batch["q"] = (batch["q"].float() * q_scale).bfloat16()
    batch["k_cache"] = (batch["k_cache"].float() / 4).to(torch.float8_e4m3fn)
    batch["v_cache"] = (batch["v_cache"].float() / 4).to(torch.float8_e4m3fn)
    kwargs = dict(scale=128**-0.5 / q_scale, k_scale=4.0, v_scale=4.0)
    expected = attention_f64(**batch, **kwargs)
    errors = {}
    for hopper in (True, False):
        monkeypatch.setattr(operands, "_is_hopper", lambda index, hopper=hopper: hopper)
        assert operands.quantizes_q(torch.float8_e4m3fn, batch["q"].device, 64, 128) == hopper
        out = run_kernel(batch, **kwargs)
        assert not out.isnan().any()
        errors[hopper] = ((out.double() - expected).norm() / expected.norm()).item()
    assert errors[True] < 5e-3 and errors[True] < 1.5 * errors[False] + 1e-3, errors


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 32])
def test_gpu_fp8_cache_at_small_head_dims_in_64_row_tiles(head_dim):
    # D 16 is below the e4m3 MMA's 32-element step: the fp16 score dot must serve it (it once failed
    # to compile); D 32 takes the e4m3 one
    batch = make_batch([16, 16, 200], [300, 47, 0], 16, 4, head_dim, dtype=torch.bfloat16, device="cuda")
    batch["k_cache"] = (batch["k_cache"].float() * 2).to(torch.float8_e4m3fn)
    batch["v_cache"] = (batch["v_cache"].float() * 2).to(torch.float8_e4m3fn)
    expected = attention_f64(**batch, k_scale=0.5, v_scale=0.5)
    assert_close(run_kernel(batch, k_scale=0.5, v_scale=0.5), expected, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_graph_replay_follows_new_lengths():
    # captured once at short lengths, replayed after the lengths (on the device) grow
    batch = make_batch([16, 16], [6000, 100], 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    seq_lens = batch["seq_lens"].clone()
    batch["seq_lens"].copy_(torch.tensor([40, 20], dtype=torch.int32))
    out = torch.empty_like(batch["q"])
    kernels.paged_attention(**batch, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_attention(**batch, out=out)
    batch["seq_lens"].copy_(seq_lens)
    out.fill_(float("nan"))
    graph.replay()
    assert_close(out, attention_f64(**batch), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_gpu_head_dim_256_takes_tiles_that_fit_shared_memory(cache):
    # the widest head dim: a prefill chunk, a verify block and decodes at the default tiles (the
    # 5-stage tiles measured at D 128 are not taken here; their D 256 buffers would not fit)
    mixed = ([300, 16, 1, 1], [500, 2000, 4000, 0])
    decode = ([1] * 24, [1 + (i * 397) % 2100 for i in range(24)])  # 96 items: 2 splits each
    for q_lens, ctx in (mixed, decode):
        batch = make_batch(q_lens, ctx, 16, 4, 256, dtype=torch.bfloat16, device="cuda")
        scales = {}
        if cache == "fp8":
            scales = dict(k_scale=0.5, v_scale=0.25)
            batch["k_cache"] = (batch["k_cache"].float() / 0.5).to(torch.float8_e4m3fn)
            batch["v_cache"] = (batch["v_cache"].float() / 0.25).to(torch.float8_e4m3fn)
        assert_close(run_kernel(batch, **scales), attention_f64(**batch, **scales), torch.bfloat16)
