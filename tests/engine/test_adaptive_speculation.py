"""Adaptive speculation through the whole engine: whatever k each step verifies, greedy output equals
target-only decoding bit for bit (alone, batched, over the prefix cache, with and without async
scheduling), a request's own `num_speculative_tokens` caps what counts for it alone, and the plan
adapts only when asked, and only for DFlash."""

from __future__ import annotations

import pytest
from engine_helpers import make_pair, random_prompts

from target_service.assembly.engine_args import EngineArgs
from target_service.assembly.plan import resolve_plan
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

SETTINGS = dict(kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=8, max_model_len=160)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_output_is_target_only_whatever_k_each_step_verifies(tmp_path, async_scheduling):
    target, drafter = make_pair(tmp_path, block_size=8)
    prompts = random_prompts(6, 160)
    plain = LLM(target, **SETTINGS)
    expected = token_ids(plain, prompts)
    plain.close()
    llm = LLM(target, drafter, adaptive_speculation=True, async_scheduling=async_scheduling, **SETTINGS)
    try:
        assert token_ids(llm, prompts[:1]) == expected[:1]
        assert token_ids(llm, prompts) == expected
        assert token_ids(llm, prompts) == expected  # over the prefix cache
        steps = llm.engine.counters().decode_steps_by_drafts
        # the choices are (0, 1, 3, 7); more than one was taken (unmeasured ones are tried where they
        # could win), and every one taken is a choice
        assert len(steps) >= 2 and set(steps) <= {0, 1, 3, 7}, steps
        assert llm.stats.num_drafts > 0
        usage = llm.engine.pool_usage()
        assert usage.num_used_blocks == 0 and usage.num_seqs == 0
    finally:
        llm.close()


def test_a_requests_own_draft_limit_caps_only_its_counts_and_changes_no_token(tmp_path):
    target, drafter = make_pair(tmp_path, block_size=8)
    prompts = random_prompts(3, 160)
    limits = [None, 0, 2]
    params = [GREEDY.model_copy(update={"num_speculative_tokens": limit}) for limit in limits]
    plain = LLM(target, **SETTINGS)
    expected = token_ids(plain, prompts)
    plain.close()
    for adaptive in (False, True):
        llm = LLM(target, drafter, adaptive_speculation=adaptive, **SETTINGS)
        try:
            outs = llm.generate(prompts, params)
            assert [out.outputs[0].token_ids for out in outs] == expected
            stats = [out.spec_decode for out in outs]
            assert stats[0].num_drafts > 0
            assert stats[1].num_drafts == 0  # 0: nothing counts, plain decoding
            assert 0 < stats[2].num_draft_tokens <= 2 * stats[2].num_drafts  # at most 2 count per step
            assert len(stats[2].accepted_per_position) <= 2
        finally:
            llm.close()


def test_the_plan_adapts_by_default_on_a_gpu_unless_k_is_pinned_and_only_for_dflash(tmp_path):
    target, drafter = map(str, make_pair(tmp_path, block_size=8))

    def plan(**fields):
        return resolve_plan(EngineArgs(target=target, **fields), cuda_devices=1)

    assert plan(drafter=drafter, device="cuda").speculation_choices == (0, 1, 3, 7)  # on by default
    assert plan(drafter=drafter, device="cuda", num_speculative_tokens=7).speculation_choices == (7,)  # -k
    assert plan(drafter=drafter, device="cuda", adaptive_speculation=False).speculation_choices == (7,)
    assert plan(drafter=drafter, device="cpu").speculation_choices == (7,)  # nothing measured on a CPU
    assert plan(drafter=drafter, device="cuda", adaptive_speculation=True).speculation_choices == (0, 1, 3, 7)
    assert plan(drafter=drafter, device="cpu", num_speculative_tokens=5,
                adaptive_speculation=True).speculation_choices == (0, 1, 3, 5)
    assert plan(device="cuda").speculation_choices == (0,)  # plain decoding
    for method, drafter_dir in (("ngram", None), ("hybrid", drafter)):
        with pytest.raises(ValueError, match="adaptive_speculation needs speculative_method 'dflash'"):
            plan(drafter=drafter_dir, device="cpu", speculative_method=method, adaptive_speculation=True)


def test_a_request_asking_for_negative_drafts_is_refused_by_name():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
