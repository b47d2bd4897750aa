"""Greedy speculative decoding is lossless: with a drafter, tokens equal target-only greedy decoding.

Covered: batch sizes and prompt lengths, K in {1, 3, 7}, paged and dense context, prefix caching on
and off with a second round sharing prefixes, preemption in a pool too small for the batch, and an
oracle drafter that makes acceptance high, so multi-token accepts, commits and context writes run.
"""

import pytest
import torch
from engine_helpers import OracleDrafter, make_pair, random_prompts

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("pool_transport")


def reference_outputs(target, prompts, params=GREEDY):
    llm = LLM(target, kv_cache_memory="4MiB", tokens_per_block=16)
    outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert llm.engine.pool_usage().num_used_blocks == 0
    llm.close()
    return outputs


def assert_no_page_in_use(llm: LLM):
    usage = llm.engine.pool_usage()
    assert usage.num_used_blocks == 0 and usage.num_seqs == 0


@pytest.mark.parametrize("num_draft", [1, 3, 7])
@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_greedy_with_drafter_equals_target_only(tmp_path, num_draft, storage):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(4, 160)
    expected = reference_outputs(target, prompts)
    llm = LLM(target, drafter, num_speculative_tokens=num_draft, context_storage=storage,
              kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=8, max_model_len=128)
    for batch in (prompts[:1], prompts):
        got = [out.outputs[0].token_ids for out in llm.generate(batch, GREEDY)]
        assert got == expected[: len(batch)]
    assert llm.stats.num_drafts > 0 and llm.stats.num_draft_tokens <= llm.stats.num_drafts * num_draft
    assert_no_page_in_use(llm)
    llm.close()


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_oracle_drafter_accepts_exactly_the_uncorrupted_prefix(tmp_path, storage):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(3, 160, low=5, high=50)
    expected = reference_outputs(target, prompts)
    llm = LLM(target, drafter, num_speculative_tokens=7, context_storage=storage, kv_cache_memory="4MiB",
              tokens_per_block=16, max_model_len=128, max_num_seqs=8)
    oracle = OracleDrafter(llm, {tuple(p): p + out for p, out in zip(prompts, expected)})
    got = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    assert got == expected
    assert llm.stats.num_accepted_tokens == oracle.expected_accepted
    assert llm.stats.mean_acceptance_length > 2.0  # multi-token accepts really happened
    for seq_id, positions in oracle.stored.items():
        # every committed position got its draft context exactly once, in order, from 0
        assert positions == list(range(len(positions))), seq_id
    assert_no_page_in_use(llm)
    llm.close()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_second_round_sharing_prefixes(tmp_path, prefix_caching):
    target, drafter = make_pair(tmp_path)
    shared = torch.randint(3, 160, (40,)).tolist()
    first = [shared + torch.randint(3, 160, (n,)).tolist() for n in (3, 9)]
    second = [shared + torch.randint(3, 160, (n,)).tolist() for n in (1, 20)] + [shared[:33]]
    expected = reference_outputs(target, first + second)
    llm = LLM(target, drafter, num_speculative_tokens=3, kv_cache_memory="4MiB", tokens_per_block=16,
              enable_prefix_caching=prefix_caching, max_model_len=128)
    oracle = OracleDrafter(llm, {tuple(p): p + out for p, out in zip(first + second, expected)})
    assert [o.outputs[0].token_ids for o in llm.generate(first, GREEDY)] == expected[:2]
    hits_before = llm.engine.pool_usage().prefix_cache_hits
    assert [o.outputs[0].token_ids for o in llm.generate(second, GREEDY)] == expected[2:]
    hits = llm.engine.pool_usage().prefix_cache_hits - hits_before
    # 40 shared tokens = 2 full blocks of 16 for each of the 3 prompts, when caching is on
    assert hits == (3 * 32 if prefix_caching else 0)
    assert llm.stats.num_accepted_tokens == oracle.expected_accepted
    for positions in oracle.stored.values():
        # a prefix hit skips the context store of cached positions: writes start after them
        assert positions == list(range(positions[0], positions[0] + len(positions)))
        assert positions[0] in ((0, 32) if prefix_caching else (0,))
    assert_no_page_in_use(llm)
    llm.close()


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_preemption_in_a_pool_too_small_for_the_batch(tmp_path, storage):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(6, 160, low=20, high=40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = reference_outputs(target, prompts, params)
    # 12 blocks of 16 tokens: each request needs up to 5, so six cannot all run at once
    spec_bytes = 16 * (2 * 4 * 2 * 16 * 4 + (2 * 2 * 2 * 16 * 4 if storage == "paged" else 0))
    dense_bytes = 0 if storage == "paged" else 6 * 128 * 2 * 2 * 2 * 16 * 4
    llm = LLM(target, drafter, num_speculative_tokens=5, context_storage=storage, max_num_seqs=6,
              kv_cache_memory=12 * spec_bytes + dense_bytes, tokens_per_block=16, max_model_len=128)
    assert llm.engine.pool_limits.num_blocks == 12
    oracle = OracleDrafter(llm, {tuple(p): p + out for p, out in zip(prompts, expected)})
    got = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert got == expected
    assert llm.engine.counters().num_preemptions > 0
    assert llm.stats.num_accepted_tokens == oracle.expected_accepted
    assert_no_page_in_use(llm)
    llm.close()


def test_plain_decoding_without_a_drafter_counts_no_drafts(tmp_path):
    target, _ = make_pair(tmp_path)
    prompts = random_prompts(2, 160)
    llm = LLM(target, kv_cache_memory="4MiB", tokens_per_block=16)
    outputs = llm.generate(prompts, GREEDY)
    assert all(len(out.outputs[0].token_ids) == 24 for out in outputs)
    assert llm.stats.num_drafts == 0
    llm.close()


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_chunked_prefill_under_a_small_token_budget(tmp_path, storage):
    """Prompts longer than the step budget prefill in chunks, mixed with other sequences' verify blocks."""
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(4, 160, low=30, high=70)
    expected = reference_outputs(target, prompts)
    llm = LLM(target, drafter, num_speculative_tokens=3, context_storage=storage, kv_cache_memory="4MiB",
              tokens_per_block=16, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16)
    oracle = OracleDrafter(llm, {tuple(p): p + out for p, out in zip(prompts, expected)})
    steps, runner = [], llm.assembly.runner
    launch = runner.launch

    def recording_launch(plan):  # every step the scheduler plans (steps ahead hold no prefill)
        rows = sum(c.num_tokens for c in plan.prefills) + sum(w.num_verified + 1 for w in plan.decodes)
        steps.append((len(plan.prefills), len(plan.decodes), rows))
        return launch(plan)

    runner.launch = recording_launch
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)] == expected
    assert max(tokens for *_, tokens in steps) <= 16
    assert any(prefills and decodes for prefills, decodes, _ in steps)  # mixed steps happened
    assert llm.stats.num_accepted_tokens == oracle.expected_accepted
    for positions in oracle.stored.values():
        assert positions == list(range(len(positions)))
    assert_no_page_in_use(llm)
    llm.close()
