"""The pool's assembler: blocks for a budget (paged and dense, hand-computed), and what it hands out."""

import pickle

import pytest
import torch

from kvpool_service.assembler import PoolArgs, build_pool, size_pool
from kvpool_service.geometry import LayerGroup, PoolSpec, dense_context_bytes
from kvpool_service.memory import PoolMemory

TPB = 16


def make_spec() -> PoolSpec:
    # target: 2 layers x 2 heads x 16 x 2 bytes x (K, V) = 256 B/token; draft: 1 x 1 x 32 x 2 x 2 = 128
    return PoolSpec(
        target=LayerGroup(name="target", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16"),
        draft=LayerGroup(name="draft", num_layers=1, num_kv_heads=1, head_dim=32, dtype="bfloat16"),
        tokens_per_block=TPB)


def test_paged_blocks_price_target_and_draft_bytes_together():
    budget = 100 * TPB * 384 + 5000  # 100 blocks of 16 tokens x (256 + 128) bytes, plus change
    sizing = size_pool(make_spec(), budget, context_storage="paged", max_num_seqs=4, max_model_len=100)
    assert (sizing.num_blocks, sizing.dense_context_bytes, sizing.spec.draft is not None) == (100, 0, True)


def test_dense_context_is_reserved_first_and_the_pool_keeps_the_target_only():
    # 4 sequences x 100 positions padded to 112 (7 pages of 16) x 128 bytes
    reserved = 4 * 112 * 128
    assert dense_context_bytes(make_spec(), max_num_seqs=4, max_model_len=100) == reserved
    budget = reserved + 30 * TPB * 256
    sizing = size_pool(make_spec(), budget, context_storage="dense", max_num_seqs=4, max_model_len=100)
    assert (sizing.num_blocks, sizing.dense_context_bytes, sizing.spec.draft) == (30, reserved, None)


def test_budgets_that_buy_too_little_are_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"dense context reservation of .* leaves nothing of the"):
        size_pool(make_spec(), 4 * 112 * 128, context_storage="dense", max_num_seqs=4, max_model_len=100)
    message = r"KV budget of 6.00 KiB holds 1 blocks of 6.00 KiB; give more kv_cache_memory"
    with pytest.raises(ValueError, match=message):
        size_pool(make_spec(), TPB * 384, context_storage="paged", max_num_seqs=4, max_model_len=100)


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_built_pool_hands_out_a_handle_and_a_control_over_the_same_blocks(storage):
    args = PoolArgs(spec=make_spec(), budget_bytes=2**20, context_storage=storage, max_num_seqs=4,
                    max_model_len=100, share=False)
    pool = build_pool(args)
    try:
        assert pool.control.limits().num_blocks == pool.layout.num_blocks == pool.sizing.num_blocks
        assert pool.blocks.enable_prefix_caching == (storage == "paged")  # a hit cannot restore dense context
        with PoolMemory.attach(pool.handle, pool.layout) as attached:
            attached.layer("target", 1).k_cache[3, 2].fill_(7.0)
            assert torch.all(pool.memory.arena("target")[3, 1, 0, 2] == 7.0)
        with pytest.raises(TypeError, match="cannot leave its process"):
            pickle.dumps(pool.handle)
    finally:
        pool.close()


def test_pool_args_refuse_unknown_or_bad_fields():
    with pytest.raises(ValueError, match="watermark"):
        PoolArgs(spec=make_spec(), budget_bytes=2**20, max_num_seqs=4, max_model_len=100, watermark=1.5)
    with pytest.raises(ValueError, match="extra_field"):
        PoolArgs(spec=make_spec(), budget_bytes=2**20, max_num_seqs=4, max_model_len=100, extra_field=1)
