"""kernels.paged_attention (Triton) against the float64 oracle of `paged_cases`.

On a machine without a GPU the kernel runs under the interpreter on CPU tensors; with one, the
same cases run compiled on CUDA tensors (fp32 then means tf32 dots). The cases at realistic sizes,
bf16 and fp8, are in test_paged_attention_gpu.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from paged_cases import CUDA, DEVICE, assert_close, attention_f64, make_batch, run_kernel

import kernels
from kernels import reference, split_kv
from kernels.paged_attention import _launch_paged_attention
from kernels.paged_tiles import TileConfig, choose_tiles


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


def launch(batch, num_splits=None, **kwargs):
    """The launcher behind `kernels.paged_attention`, for the paths its defaults never take."""
    out = torch.full_like(batch["q"], float("nan"))
    _launch_paged_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_table"],
                            batch["seq_lens"], batch["query_start_loc"], None, None, None, num_splits, out,
                            **kwargs)
    return out


@pytest.mark.parametrize("search", [1, 16, 64])
def test_every_program_finds_its_sequence_however_it_searches(search):
    # 37 sequences of mixed query counts (empty ones too): several 16-wide search steps, or bisection
    q_lens = torch.randint(0, 6, (37,)).tolist()
    q_lens[0], q_lens[-1] = 3, 1
    ctx_lens = torch.randint(0, 40, (37,)).tolist()
    batch = make_batch(q_lens, ctx_lens, 4, 2, 16)
    assert_close(launch(batch, seq_search=search), attention_f64(**batch), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("q_lens", [[1] * 23, [0, 6, 0, 0, 1, 0, 0, 1]], ids=["decode", "uneven"])
def test_launches_of_as_many_queries_as_sequences_find_every_owner(q_lens, num_splits):
    # T == B: pure decode, and an uneven batch where a range longer than a tile shifts the owners
    # of later tiles (kernel_variants_22_decode_guess, in git history, timed a guess of them)
    assert sum(q_lens) == len(q_lens)
    ctx_lens = torch.randint(0, 60, (len(q_lens),)).tolist()
    batch = make_batch(q_lens, ctx_lens, 8, 2, 16)
    assert_close(run_kernel(batch, num_splits=num_splits), attention_f64(**batch), torch.float32)


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
def test_merge_in_the_last_split_and_merge_kernel_agree(fused):
    # decode and short verify rows: the last split of each (tile, head) merges, or a merge kernel does
    max_fused = split_kv.MAX_SPLITS if fused else 0
    for _ in range(2):  # a second call needs the counters the first one left at zero
        batch = make_batch([1, 2, 1], [200, 90, 37], 8, 2, 32)
        out = launch(batch, num_splits=4, fused_merge_max_splits=max_fused)
        assert_close(out, attention_f64(**batch), torch.float32)
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
    out = launch(batch, num_splits, tiles=TileConfig(4, 16, block_n, 4, 1, key_lanes))
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
