"""PoolSpec and plan_pool against hand-computed budgets."""

import random

import pytest

from kvpool_service.geometry import LayerGroup, PoolLayout, PoolSpec, plan_pool

GIB = 2**30


def qwen3_8b_spec(context_dtype="bfloat16", tokens_per_block=32):
    target = LayerGroup(name="target", num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    draft = LayerGroup(name="draft", num_layers=5, num_kv_heads=8, head_dim=128, dtype=context_dtype)
    return PoolSpec(target=target, draft=draft, tokens_per_block=tokens_per_block)


def test_qwen3_8b_with_dflash_b16_costs_167936_bytes_per_token_and_7992_blocks_in_40gib():
    spec = qwen3_8b_spec()
    assert spec.target.bytes_per_token == 147_456
    assert spec.draft.bytes_per_token == 20_480
    assert spec.bytes_per_token == 167_936
    assert spec.num_blocks(40 * GIB) == 7_992


def test_draft_is_counted_from_its_own_shape():
    """Random geometries: bytes per token is 2*L*H*D*itemsize per group, summed, never the target twice."""
    rng = random.Random()
    for _ in range(50):
        t_layers, d_layers = rng.randint(1, 80), rng.randint(1, 12)
        t_heads, d_heads = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8, 16])
        t_dim, d_dim = rng.choice([64, 128, 256]), rng.choice([16, 64, 128])
        spec = PoolSpec(
            target=LayerGroup(name="target", num_layers=t_layers, num_kv_heads=t_heads, head_dim=t_dim,
                              dtype="float16"),
            draft=LayerGroup(name="draft", num_layers=d_layers, num_kv_heads=d_heads, head_dim=d_dim,
                             dtype="float32"),
            tokens_per_block=16,
        )
        expected = 2 * t_layers * t_heads * t_dim * 2 + 2 * d_layers * d_heads * d_dim * 4
        assert spec.bytes_per_token == expected
        budget = rng.randint(1, 10**11)
        assert spec.num_blocks(budget) == budget // (16 * expected)


def test_fp8_context_halves_draft_bytes_and_counts_per_layer_scales():
    spec = qwen3_8b_spec(context_dtype="float8_e4m3fn")
    assert spec.draft.bytes_per_token == 10_240
    assert spec.fixed_bytes == 2 * 5 * 4
    budget = 40 * GIB
    assert spec.num_blocks(budget) == (budget - 40) // (32 * (147_456 + 10_240))


def test_plan_paged_versus_dense_by_hand():
    spec = qwen3_8b_spec()
    plan = plan_pool(spec, 80 * GIB, max_model_len=8192, max_num_seqs=64, avg_seq_len=1000)
    blocks = 80 * GIB // (32 * 167_936)
    assert plan.num_blocks == blocks and plan.max_tokens == blocks * 32
    assert blocks == 15_984 and blocks // 32 == 499  # 1000 tokens hold 32 blocks
    assert plan.paged.uncapped_requests == 499
    assert plan.paged.concurrent_requests == 64  # the blocks hold 499, but max_num_seqs runs 64 at once
    assert plan.paged.draft_context_bytes == blocks * 32 * 20_480
    reservation = 64 * 8192 * 20_480
    dense_blocks = (80 * GIB - reservation) // (32 * 147_456)
    assert plan.dense.draft_context_bytes == reservation
    assert plan.dense.num_blocks == dense_blocks
    assert dense_blocks == 15_928 and plan.dense.uncapped_requests == 497  # 70 GiB left after 10 GiB
    assert plan.dense.concurrent_requests == 64


def test_dense_reservation_larger_than_budget_leaves_no_target_pool():
    plan = plan_pool(qwen3_8b_spec(), 1 * GIB, max_model_len=32768, max_num_seqs=64)
    assert plan.dense.num_blocks == 0 and plan.dense.concurrent_requests == 0
    assert plan.paged.num_blocks > 0


@pytest.mark.parametrize("field,value", [("head_dim", 96), ("head_dim", 8), ("num_layers", 0)])
def test_bad_group_geometry_is_rejected(field, value):
    fields = dict(name="draft", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    fields[field] = value
    with pytest.raises(ValueError, match=field):
        LayerGroup(**fields)


@pytest.mark.parametrize("tokens_per_block", [0, 24, 8])
def test_tokens_per_block_must_be_a_power_of_two_at_least_16(tokens_per_block):
    with pytest.raises(ValueError, match="tokens_per_block"):
        qwen3_8b_spec(tokens_per_block=tokens_per_block)


def test_each_pool_layout_gets_a_fresh_epoch():
    spec = qwen3_8b_spec()
    epochs = {PoolLayout.create(spec, 10).epoch for _ in range(20)}
    assert len(epochs) == 20 and min(epochs) >= 1
