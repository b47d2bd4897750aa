"""Every drafting sequence verifies the same K rows, so a decode step stays one CUDA graph; one
allowed fewer drafts (near its max_tokens) has the extra ones verified and never accepted."""

import torch
from engine_helpers import make_pair, random_prompts

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM


def test_the_engine_verifies_k_rows_for_every_decode_and_counts_only_the_usable_drafts(tmp_path):
    target, drafter = make_pair(tmp_path)
    llm = LLM(target, drafter, num_speculative_tokens=7, kv_cache_memory="4MiB", tokens_per_block=16,
              max_model_len=160, async_scheduling=False)
    engine, runner, plans = llm.engine, llm.assembly.runner, []
    launch = runner.launch
    runner.launch = lambda plan: plans.append(plan) or launch(plan)
    budgets = [2, 5, 40]  # max_tokens: the first two sequences are near their end after one token
    seqs = [engine.add_request(f"r{i}", torch.randint(3, 150, (9,)).tolist(),
                               SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True))
            for i, budget in enumerate(budgets)]
    engine.step()  # the prefills: each sequence now has its first token
    engine.step()
    plan = plans[-1]
    assert [work.num_verified for work in plan.decodes] == [7, 7, 7]
    # by hand: max_tokens - outputs - 1, capped at K
    assert [work.max_accepted for work in plan.decodes] == [0, 3, 7]
    assert [work.seq for work in plan.decodes] == seqs
    llm.close()


def test_decode_steps_stay_uniform_and_tokens_equal_target_only(tmp_path):
    """Requests of different max_tokens end at different steps; every decode-only step verifies one
    row count (what the graphs need), no request accepts more drafts than it may, and the tokens are
    target-only greedy's."""
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(5, 160, low=3, high=30)
    params = [SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True)
              for n in torch.randint(5, 40, (len(prompts),))]
    plain = LLM(target, kv_cache_memory="4MiB", tokens_per_block=16)
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, params)]
    plain.close()
    llm = LLM(target, drafter, num_speculative_tokens=7, kv_cache_memory="4MiB", tokens_per_block=16,
              max_model_len=160)
    runner, row_counts = llm.assembly.runner, []
    forward = runner._forward

    def recording_forward(batch, plan, verified):
        if plan.decodes and not plan.prefills:
            row_counts.append({1 + count for count in verified})
        return forward(batch, plan, verified)

    runner._forward = recording_forward
    outputs = llm.generate(prompts, params)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert [len(tokens) for tokens in expected] == [p.max_tokens for p in params]
    assert row_counts and all(counts == {8} for counts in row_counts)
    assert llm.stats.num_accepted_tokens <= llm.stats.num_draft_tokens
    llm.close()
