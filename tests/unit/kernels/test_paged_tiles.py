"""The paged kernel's launch-shape rules: `choose_tiles`, key lanes, stages, `default_tiles`.

They read static shapes and dtypes only, so their GPU rules are checked here without a GPU; the
shapes they pick are run against a float64 oracle in test_paged_attention.py and its _gpu twin.
"""

from unittest import mock

import torch

from kernels import split_kv
from kernels.paged_tiles import (
    DOUBLE_BUFFER_STAGES,
    choose_tiles,
    default_tiles,
    with_double_buffering,
    with_key_lanes,
)


def test_gpu_tile_rules_follow_the_regime_and_the_operand_width():
    # choose_tiles reads shapes and dtypes only, so its GPU rules are checkable without a GPU
    cuda, fp8, bf16, fp32 = torch.device("cuda"), torch.float8_e4m3fn, torch.bfloat16, torch.float32
    decode = choose_tiles(32, 32, 4, 128, cuda, bf16)
    assert (decode.block_q, decode.block_m, decode.block_n) == (4, 16, 128)
    q8 = choose_tiles(8 * 32, 32, 4, 128, cuda, bf16)  # 32 rows: 128 keys
    assert (q8.block_q, q8.block_m, q8.block_n) == (8, 32, 128)
    q16 = choose_tiles(16 * 32, 32, 4, 128, cuda, bf16)  # 64 rows: 64 keys
    assert (q16.block_q, q16.block_m, q16.block_n) == (16, 64, 64)
    q8_fp8 = choose_tiles(8 * 32, 32, 4, 128, cuda, fp8)  # fp8 verify: 128 keys whatever the rows
    assert (q8_fp8.block_q, q8_fp8.block_m, q8_fp8.block_n) == (8, 32, 128)
    prefill = choose_tiles(8192, 1, 4, 128, cuda, bf16)
    assert tuple(prefill) == (64, 256, 64, 8, 3, 1)  # (q, m, n, warps, stages, key lanes)
    prefill_fp8 = choose_tiles(8192, 1, 4, 128, cuda, fp8)  # the fp8 verify tile: two programs per SM
    assert tuple(prefill_fp8) == (16, 64, 128, 4, 2, 1)
    assert tuple(choose_tiles(8192, 1, 4, 256, cuda, fp8)) == (32, 128, 64, 8, 3, 1)  # D 256: shared memory
    wide = choose_tiles(8192, 1, 4, 128, cuda, fp32, fp32)  # 32-bit operands: half the rows, 2 stages
    assert (wide.block_m, wide.num_stages) == (128, 2)
    assert choose_tiles(8192, 1, 4, 256, cuda, bf16).block_m == 128  # D 256
    assert choose_tiles(8 * 32, 32, 4, 128, torch.device("cpu"), fp8).block_m == 32  # interpreter
    assert decode.key_lanes == q8.key_lanes == q8_fp8.key_lanes == 1  # key lanes come after the split plan


def test_gpu_key_lanes_only_for_fp8_tiles_of_16_rows_that_walk_whole_contexts():
    # measured on an H200: faster for fp8 decode / short verify without splits, slower elsewhere
    cuda, fp8, bf16 = torch.device("cuda"), torch.float8_e4m3fn, torch.bfloat16
    decode = choose_tiles(128, 128, 4, 128, cuda, fp8)
    assert tuple(with_key_lanes(decode, fp8, False, cuda)) == (4, 16, 128, 4, 2, 4)  # stages: see below
    q4 = choose_tiles(4 * 32, 32, 4, 128, cuda, fp8)  # 16 rows
    assert with_key_lanes(q4, fp8, False, cuda).key_lanes == 4
    assert with_key_lanes(decode, fp8, True, cuda) == decode  # split: few tiles per program
    assert with_key_lanes(decode, bf16, False, cuda) == decode
    q8 = choose_tiles(8 * 32, 32, 4, 128, cuda, fp8)  # 32 rows
    assert with_key_lanes(q8, fp8, False, cuda) == q8
    cpu_tiles = choose_tiles(128, 128, 4, 128, torch.device("cpu"), fp8)
    assert with_key_lanes(cpu_tiles, fp8, False, torch.device("cpu")) == cpu_tiles  # interpreter tiles
    with mock.patch.object(split_kv, "num_sms", lambda device: 132):  # what the launcher takes
        assert default_tiles(128, 128, 32, 8, 128, cuda, fp8).key_lanes == 4  # 1024 items: no split
        assert default_tiles(1, 1, 32, 8, 128, cuda, fp8).key_lanes == 1  # 8 items: split
        assert default_tiles(128, 128, 32, 8, 128, cuda, fp8, num_splits=2).key_lanes == 1


def test_gpu_double_buffered_stages_where_few_splits_leave_long_key_ranges():
    # measured on an H200: 5 stages (two K/V buffers behind the page-id loads) for fp8 tiles of <= 32
    # rows unless each work item splits more than FEW_SPLITS ways, and for bf16 64 x 64 verify tiles
    # of at most WAVES programs per SM
    cuda, cpu, fp8, bf16 = torch.device("cuda"), torch.device("cpu"), torch.float8_e4m3fn, torch.bfloat16
    deep = DOUBLE_BUFFER_STAGES
    cases = ((1, fp8, deep, deep), (4, fp8, deep, deep), (8, fp8, deep, deep), (16, fp8, 2, 2),
             (1, bf16, 3, 3), (8, bf16, 3, 3), (16, bf16, deep, 3))  # (q_len, cache, stages few, many items)
    with mock.patch.object(split_kv, "num_sms", lambda device: 132):
        for q_len, cache, few, many in cases:
            tiles = choose_tiles(q_len * 32, 32, 4, 128, cuda, cache)
            for max_splits in (1, 4):  # 264 programs: two per SM of 132
                assert with_double_buffering(tiles, cache, 128, 264, max_splits, cuda).num_stages == few
                assert with_double_buffering(tiles, cache, 128, 265, max_splits, cuda).num_stages == many
            assert with_double_buffering(tiles, cache, 128, 8, 5, cuda) == tiles  # many splits each
            assert with_double_buffering(tiles, cache, 256, 8, 1, cuda) == tiles  # D 256: not measured
        prefill = choose_tiles(8192, 1, 4, 128, cuda, bf16)
        assert with_double_buffering(prefill, bf16, 128, 8, 1, cuda) == prefill
        cpu_tiles = choose_tiles(128, 128, 4, 128, cpu, fp8)
        assert with_double_buffering(cpu_tiles, fp8, 128, 8, 1, cpu) == cpu_tiles  # interpreter tiles
        # what the launcher takes: Qwen3-8B geometry (8 KV heads), 132 SMs
        assert tuple(default_tiles(128, 128, 32, 8, 128, cuda, fp8)) == (4, 16, 128, 4, deep, 4)
        assert tuple(default_tiles(8, 8, 32, 8, 128, cuda, fp8)) == (4, 16, 128, 4, deep, 1)  # 4 splits
        assert tuple(default_tiles(1, 1, 32, 8, 128, cuda, fp8)) == (4, 16, 128, 4, 2, 1)  # 33 splits
        assert default_tiles(16 * 8, 8, 32, 8, 128, cuda, bf16).num_stages == deep  # 4 splits
        assert default_tiles(16 * 32, 32, 32, 8, 128, cuda, bf16).num_stages == deep  # 256 programs
        assert default_tiles(16 * 128, 128, 32, 8, 128, cuda, bf16).num_stages == 3  # 1024 programs
        assert default_tiles(16, 1, 32, 8, 128, cuda, bf16).num_stages == 3  # 33 splits
