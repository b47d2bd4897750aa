"""kernels.paged_attention (Triton) against a float64 oracle written here.

On a machine without a GPU the kernel runs under the interpreter on CPU tensors; with one, the
same cases run compiled on CUDA tensors (fp32 then means tf32 dots), plus the `gpu` cases at
realistic sizes. Every case draws fresh random queries and pages, shuffles the block tables,
ends lengths mid-page and poisons the output with NaN first, so an unwritten or misplaced row
cannot pass.
"""

from __future__ import annotations

import importlib
import itertools
from unittest import mock

import pytest
import torch

import kernels
from kernels import operands, reference, split_kv
from kernels.paged_attention import TileConfig, _launch_paged_attention, choose_tiles, default_tiles

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# relative L2 error bounds; compiled fp32 runs its dots in tf32, the interpreter in true fp32
TOL = {torch.float32: 5e-3 if CUDA else 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def attention_f64(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=None,
                  k_scale=1.0, v_scale=1.0):
    """Causal attention of each sequence's queries over its de-paged keys, in float64."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    tokens_per_block = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        pos = torch.arange(seq_len, device=q.device)
        pages = block_table[b].long()[pos // tokens_per_block]
        keys = k_cache[pages, pos % tokens_per_block].double() * float(k_scale)  # [n, NKV, D]
        values = v_cache[pages, pos % tokens_per_block].double() * float(v_scale)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), keys) * scale
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def make_batch(q_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_dim=32, tokens_per_block=16,
               dtype=torch.float32, device=DEVICE):
    """Random queries and pages for sequences of q_lens new queries after ctx_lens cached keys."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    pages = [-(-n // tokens_per_block) for n in seq_lens]
    num_blocks = sum(pages) + 3  # a few pages no sequence owns
    ids = torch.randperm(num_blocks, device=device).int()
    table = torch.full((len(q_lens), max(pages) + 1), -1, dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = ids[used:used + n]
        used += n
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    starts = torch.tensor([0, *q_lens], device=device).cumsum(0).int()
    return dict(
        q=torch.randn(int(starts[-1]), num_heads, head_dim, device=device).to(dtype),
        k_cache=torch.randn(shape, device=device).to(dtype),
        v_cache=torch.randn(shape, device=device).to(dtype),
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts,
    )


def run_kernel(batch, **kwargs):
    out = torch.full_like(batch["q"], float("nan"))
    result = kernels.paged_attention(**batch, out=out, backend="triton", **kwargs)
    assert result is out
    return out


def assert_close(out, expected, dtype):
    assert not out.isnan().any(), "some output rows were never written"
    err = (out.double() - expected).norm() / expected.norm()
    assert err < TOL[dtype], f"relative error {err:.2e} above {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 32), (4, 4, 16), (8, 1, 64)])
def test_mixed_prefill_verify_decode_batch(dtype, num_heads, num_kv_heads, head_dim):
    # a prefill chunk after a cached prefix, a verify block, two decodes, a fresh short prompt
    batch = make_batch([23, 16, 1, 1, 5], [18, 37, 50, 0, 0], num_heads, num_kv_heads, head_dim,
                       dtype=dtype)
    assert_close(run_kernel(batch), attention_f64(**batch), dtype)


def test_prefill_tiles_with_decodes_in_the_batch():
    # a mean of > 16 queries per sequence switches to the large prefill tile: decodes ride along
    batch = make_batch([40, 1], [9, 33], 8, 2, 32)
    assert choose_tiles(41, 2, 4, 32, torch.device("cpu")).block_m == 128
    assert_close(run_kernel(batch), attention_f64(**batch), torch.float32)


def test_every_query_count_from_1_to_16():
    q_lens = list(range(1, 17))
    ctx_lens = [(7 * q + 3) % 29 for q in q_lens]  # includes empty contexts and mid-page ends
    batch = make_batch(q_lens, ctx_lens, 4, 2, 16, dtype=torch.float16)
    assert_close(run_kernel(batch), attention_f64(**batch), torch.float16)


@pytest.mark.parametrize("search", [1, 16, 64])
def test_every_program_finds_its_sequence_however_it_searches(search, monkeypatch):
    # 37 sequences of mixed query counts (empty ones too): several 16-wide search steps, or bisection
    monkeypatch.setattr(importlib.import_module("kernels.paged_attention"), "SEQ_SEARCH", search)
    q_lens = torch.randint(0, 6, (37,)).tolist()
    q_lens[0], q_lens[-1] = 3, 1
    ctx_lens = torch.randint(0, 40, (37,)).tolist()
    batch = make_batch(q_lens, ctx_lens, 4, 2, 16)
    assert_close(run_kernel(batch), attention_f64(**batch), torch.float32)


@pytest.mark.parametrize("tokens_per_block", [8, 16, 32])
def test_chunked_prefill_equals_one_shot_prefill(tokens_per_block):
    # the same prompt attended in one pass and in chunks whose earlier K/V sit cached in pages
    prompt_len, chunks = 41, [0, 17, 30, 41]
    batch = make_batch([prompt_len], [0], 4, 2, 32, tokens_per_block)
    one_shot = run_kernel(batch)
    for lo, hi in itertools.pairwise(chunks):
        chunk = dict(batch, q=batch["q"][lo:hi],
                     seq_lens=torch.tensor([hi], dtype=torch.int32, device=DEVICE),
                     query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE))
        tol = 2e-3 if CUDA else 1e-5
        torch.testing.assert_close(run_kernel(chunk), one_shot[lo:hi], rtol=tol, atol=tol)
    assert_close(one_shot, attention_f64(**batch), torch.float32)


@pytest.mark.parametrize("num_splits", [2, 5, None])
def test_split_kv_matches_single_pass(num_splits):
    # None on CPU plans splits for a small batch (the planner assumes a few SMs there)
    batch = make_batch([1, 16, 3], [300, 70, 0], 4, 1, 32)
    assert_close(run_kernel(batch, num_splits=num_splits), attention_f64(**batch), torch.float32)


@pytest.mark.parametrize("fused", [True, False])
def test_merge_in_the_last_split_and_merge_kernel_agree(fused, monkeypatch):
    # decode and short verify rows: the last split of each (tile, head) merges, or a merge kernel does
    monkeypatch.setattr(importlib.import_module("kernels.paged_attention"), "FUSED_MERGE_MAX_SPLITS",
                        split_kv.MAX_SPLITS if fused else 0)

    for _ in range(2):  # a second call needs the counters the first one left at zero
        batch = make_batch([1, 2, 1], [200, 90, 37], 8, 2, 32)
        assert_close(run_kernel(batch, num_splits=4), attention_f64(**batch), torch.float32)
    if fused:
        counters = split_kv.arrival_counters(1, torch.device(DEVICE))  # the buffer the calls used
        assert int(counters.abs().sum()) == 0


def test_empty_query_ranges_leave_other_sequences_intact():
    batch = make_batch([4, 0, 2], [10, 20, 5], 4, 2, 16)
    assert_close(run_kernel(batch, num_splits=3), attention_f64(**batch), torch.float32)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_fp8_cache_with_scales(as_tensor):
    batch = make_batch([16, 1, 9], [25, 40, 3], 4, 2, 32)
    k_scale, v_scale = 0.37, 1.9
    fp8 = torch.float8_e4m3fn
    batch["k_cache"] = (batch["k_cache"] / k_scale).to(fp8)
    batch["v_cache"] = (batch["v_cache"] / v_scale).to(fp8)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if as_tensor:
        scales = {name: torch.tensor(value, device=DEVICE) for name, value in scales.items()}
    expected = attention_f64(**batch, k_scale=k_scale, v_scale=v_scale)
    assert_close(run_kernel(batch, **scales), expected, torch.float32)
    assert_close(run_kernel(batch, num_splits=2, **scales), expected, torch.float32)


def test_strided_pool_views_strided_queries_and_custom_scale():
    # the pool's layer view: arena [num_blocks, L, 2, tpb, NKV, D] -> K = arena[:, l, 0]
    batch = make_batch([7, 1], [12, 30], 4, 2, 32)
    num_blocks = batch["k_cache"].shape[0]
    arena = torch.randn(num_blocks, 3, 2, 16, 2, 32, device=DEVICE)
    batch["k_cache"], batch["v_cache"] = arena[:, 1, 0], arena[:, 1, 1]
    qkv = torch.randn(batch["q"].shape[0], 3 * 4, 32, device=DEVICE)
    batch["q"] = qkv[:, :4]
    expected = attention_f64(**batch, scale=0.3)
    assert_close(run_kernel(batch, scale=0.3), expected, torch.float32)


def test_auto_backend_on_cpu_is_the_reference():
    batch = make_batch([3, 1], [5, 9], device="cpu")
    expected = reference.paged_attention(**batch)
    torch.testing.assert_close(kernels.paged_attention(**batch), expected, rtol=0, atol=0)
    torch.testing.assert_close(kernels.paged_attention(**batch, backend="torch"), expected, rtol=0, atol=0)
    assert_close(expected, attention_f64(**batch), torch.float32)


def _bad(name, value):
    return {name: value}


BAD_INPUTS = [
    (lambda b: _bad("q", b["q"][0]), "q must be"),
    (lambda b: _bad("q", b["q"].to(torch.int32)), "q must be"),
    (lambda b: _bad("v_cache", b["v_cache"][:, :8]), "k_cache and v_cache"),
    (lambda b: _bad("v_cache", b["v_cache"].half()), "dtype"),
    (lambda b: _bad("q", torch.randn(b["q"].shape[0], 3, 32)), "multiple of KV heads"),
    (lambda b: _bad("q", torch.randn(b["q"].shape[0], 4, 16)), "head dim"),
    (lambda b: _bad("seq_lens", b["seq_lens"].long()), "seq_lens must be int32"),
    (lambda b: _bad("query_start_loc", b["query_start_loc"][:2]), "query_start_loc must be"),
    (lambda b: _bad("block_table", b["block_table"].long()), "block_table must be"),
    (lambda b: _bad("out", torch.empty_like(b["q"]).half()), "out must be"),
    (lambda b: _bad("scale", -1.0), "scale must be"),
    (lambda b: _bad("k_scale", torch.ones(2)), "k_scale and v_scale"),
    (lambda b: _bad("num_splits", 0), "num_splits"),
    (lambda b: _bad("backend", "cuda"), "backend must be"),
    (lambda b: _bad("seq_lens", torch.tensor([2, 9], dtype=torch.int32)), "below its query count"),
    (lambda b: _bad("seq_lens", torch.tensor([8, 90], dtype=torch.int32)), "needs 6 pages"),
    (lambda b: _bad("block_table", b["block_table"] + 100), "page ids outside"),
    (lambda b: _bad("query_start_loc", torch.tensor([0, 4, 3], dtype=torch.int32)), "never decrease"),
]


@pytest.mark.parametrize(("mutate", "message"), BAD_INPUTS)
def test_bad_input_is_rejected_with_a_clear_error(mutate, message):
    batch = make_batch([3, 1], [5, 9], device="cpu")  # value checks run on CPU tensors only
    kwargs = dict(backend="triton") | mutate(batch)
    args = {k: kwargs.pop(k, batch[k]) for k in batch}
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(*args.values(), **kwargs)


def test_split_request_on_a_head_count_the_merge_cannot_take_is_rejected():
    batch = make_batch([2], [20], num_heads=6, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="split-KV needs"):
        run_kernel(batch, num_splits=2)
    assert_close(run_kernel(batch), attention_f64(**batch), torch.float32)  # one pass still serves it


@pytest.mark.parametrize(("block_n", "key_lanes", "num_splits"), [(32, 2, None), (64, 4, None), (64, 4, 3)])
def test_key_lanes_fold_to_the_same_attention(block_n, key_lanes, num_splits):
    # decode and verify rows (causal diagonal tiles, a sequence with no cached keys, lengths ending
    # mid-tile) with each key tile dealt to independent per-row softmax states, merged at the end
    batch = make_batch([1, 4, 1, 3, 2], [37, 50, 0, 21, 90], 8, 2, 32, dtype=torch.float32)
    out = torch.full_like(batch["q"], float("nan"))
    tiles = TileConfig(4, 16, block_n, 4, 1, key_lanes)
    _launch_paged_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_table"],
                            batch["seq_lens"], batch["query_start_loc"], None, None, None, num_splits, out,
                            tiles=tiles)
    assert_close(out, attention_f64(**batch), torch.float32)


@pytest.mark.parametrize(("tiles", "message"), [
    (TileConfig(4, 16, 32, 4, 1, 3), "power of two"), (TileConfig(4, 16, 32, 4, 1, 4), ">= 16 keys"),
    (TileConfig(16, 64, 64, 4, 1, 2), "<= 32 rows")])
def test_key_lanes_the_tile_cannot_take_are_rejected(tiles, message):
    batch = make_batch([1, 1], [20, 5])
    out = torch.full_like(batch["q"], float("nan"))
    with pytest.raises(ValueError, match=message):
        _launch_paged_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_table"],
                                batch["seq_lens"], batch["query_start_loc"], None, None, None, None, out,
                                tiles=tiles)
    assert out.isnan().all()  # nothing launched


# --- compiled on a GPU: realistic sizes, bf16 and fp8, CUDA graphs ---------------------------------


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
def test_gpu_e4m3_scores_keep_the_accuracy_of_fp16_scores(q_scale):
    # verify blocks of 16 (64-row tiles) and a prefill chunk over an fp8 cache, scored in e4m3 with q
    # in two e4m3 terms: as close to float64 as the fp16 scores (q alone in e4m3 would be ~10x off)
    batch = make_batch([16, 16, 300], [3000, 700, 90], 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    batch["q"] = (batch["q"].float() * q_scale).bfloat16()
    batch["k_cache"] = (batch["k_cache"].float() / 4).to(torch.float8_e4m3fn)
    batch["v_cache"] = (batch["v_cache"].float() / 4).to(torch.float8_e4m3fn)
    kwargs = dict(scale=128**-0.5 / q_scale, k_scale=4.0, v_scale=4.0)
    expected = attention_f64(**batch, **kwargs)
    errors = {}
    for fp8_queries in (True, False):
        with mock.patch.object(operands, "FP8_QUERIES", fp8_queries):
            assert operands.quantizes_q(torch.float8_e4m3fn, batch["q"].device, 64, 128) == fp8_queries
            out = run_kernel(batch, **kwargs)
        assert not out.isnan().any()
        errors[fp8_queries] = ((out.double() - expected).norm() / expected.norm()).item()
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
