"""bench/bench_roofline.py's per-resource model against counts worked out by hand."""

from __future__ import annotations

import random

import pytest

from bench import bench_roofline as roofline

QWEN3_8B = dict(heads=32, kv_heads=8, head_dim=128)  # the paged bench's geometry


def test_fp8_verify_tile_counts_by_hand():
    # q_len 16 x group 4 = one 64-row tile per (sequence, KV head): 32 x 8 items over 8192 keys, e4m3
    # score dots (so only V is widened), P packed to fp16
    case = dict(dtype="fp8", batch=32, ctx=8192, q_len=16, bytes=1.0,
                tiles=dict(block_q=16, block_m=64, block_n=128))
    work = roofline.paged_work(case, QWEN3_8B)
    pairs = 256 * 64 * 8192
    assert work.exps == pairs
    assert work.dot_flops == 4 * pairs * 128
    assert work.conversions == (128 * 256 * 8192 + pairs) / 2


def test_bf16_decode_widens_nothing_and_pads_rows():
    # 4 query heads per KV head padded to a 16-row tile; 2000 keys round up to 16 tiles of 128
    case = dict(dtype="bf16", batch=3, ctx=2000, q_len=1, bytes=1.0,
                tiles=dict(block_q=4, block_m=16, block_n=128))
    work = roofline.paged_work(case, QWEN3_8B)
    pairs = 3 * 8 * 16 * 2048
    assert (work.exps, work.conversions) == (pairs, pairs / 2)


def test_causal_prefill_counts_whole_key_tiles_up_to_each_tiles_last_query():
    rng = random.Random()
    q_len, cached, block_q, block_n = rng.randint(20, 300), rng.randint(0, 200), 16, 32
    case = dict(dtype="bf16", batch=1, ctx=cached + q_len, q_len=q_len, bytes=1.0,
                tiles=dict(block_q=block_q, block_m=block_q * 4, block_n=block_n))
    by_hand = 0
    for first in range(0, q_len, block_q):
        last_query_position = cached + min(first + block_q, q_len) - 1
        by_hand += -(-(last_query_position + 1) // block_n) * block_n
    assert roofline.paged_work(case, QWEN3_8B).exps == 8 * block_q * 4 * by_hand


def test_estimates_combine_the_parts():
    work = roofline.Work(bytes=4e9, dot_flops=3e15, exps=2e12, conversions=1e12)
    est = roofline.estimate(work, copy_bytes_per_s=4e12, matmul_flop_per_s=6e14, sms=100)
    slow_pipe = 16 * 100 * 1.98e9
    assert est.hbm == pytest.approx(1e-3)
    assert est.tensor == pytest.approx(5.0)
    assert est.mufu == pytest.approx(2e12 / slow_pipe)
    assert est.in_order == pytest.approx(5.0 + 3e12 / slow_pipe)
    assert est.overlapped == pytest.approx(5.0)
    assert est.bound_by == "compute in order"
