"""Logprobs end to end through the engine, against HF transformers over the same tiny checkpoint
(float32, 1e-4): the raw log-probabilities of generated tokens and of echoed prompt tokens (chunked
prefills and prefix-cache hits included); the same with and without the drafter (greedy: the same
tokens, logprobs within float tolerance, multi-token accepts included); the processed mode equal to the
sampler's filtered distribution over HF's logits; and a request that asks changes nobody else's
tokens. Inputs are random, seeded from torch's generator (the seed is printed on failure)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import OracleDrafter, make_pair
from logprob_oracles import HFTarget, assert_entry_matches, processed_oracle

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

SETTINGS = dict(kv_cache_memory="4MiB", tokens_per_block=16, max_model_len=128, max_num_seqs=8)
ATOL = 1e-4


@pytest.fixture
def seed():
    value = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(value)
    print(f"seed {value}")
    return value


def prompt(length: int) -> list[int]:
    return torch.randint(3, 160, (length,)).tolist()


def greedy(max_tokens: int = 10, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)


def run(target, drafter, prompts, params, **settings):
    llm = LLM(target, drafter, **{**SETTINGS, **settings})
    try:
        return llm.generate(prompts, params), llm
    finally:
        llm.close()


def assert_matches_hf(hf: HFTarget, out, num_top: int, num_prompt_top: int | None, atol: float = ATOL
                      ) -> None:
    """Every logprob of one RequestOutput against HF's log_softmax over prompt + output."""
    prompt_ids, tokens = out.prompt_token_ids, out.outputs[0].token_ids
    rows = hf.log_softmax(prompt_ids + tokens)
    entries = out.outputs[0].logprobs
    assert len(entries) == len(tokens)
    for j, (token, entry) in enumerate(zip(tokens, entries)):
        assert_entry_matches(entry, rows[len(prompt_ids) - 1 + j], token, num_top, atol)
        if num_top:
            assert entry.logprob == entry.top_logprobs[0]  # greedy: the top one, exactly
    if num_prompt_top is None:
        assert out.prompt_logprobs is None
        return
    assert len(out.prompt_logprobs) == len(prompt_ids) and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt_ids)):
        assert_entry_matches(out.prompt_logprobs[i], rows[i - 1], prompt_ids[i], num_prompt_top, atol)


@pytest.mark.parametrize("speculative", [False, True])
def test_raw_logprobs_of_outputs_and_echoed_prompts_equal_hf_transformers(tmp_path, seed, speculative):
    """A short prompt, and one longer than a step's budget (its prompt logprobs come chunk by chunk)."""
    target, drafter = make_pair(tmp_path)
    prompts = [prompt(4), prompt(45)]
    params = [greedy(logprobs=5, prompt_logprobs=3), greedy(logprobs=0, prompt_logprobs=20)]
    drafting = dict(drafter=drafter, num_speculative_tokens=3) if speculative else dict(drafter=None)
    outputs, llm = run(target, prompts=prompts, params=params, max_num_batched_tokens=32, **drafting)
    hf = HFTarget(target)
    assert_matches_hf(hf, outputs[0], 5, 3)
    assert_matches_hf(hf, outputs[1], 0, 20)
    assert llm.assembly.runner.num_steps_ahead > 0  # steps launched ahead carried logprobs too


def test_with_and_without_the_drafter_tokens_and_logprobs_are_equal(tmp_path, seed):
    """The oracle drafter makes most drafts right, so emitted tokens come from accepted drafts' rows."""
    target, drafter = make_pair(tmp_path)
    prompts = [prompt(n) for n in (3, 17, 30)]
    params = greedy(20, logprobs=4, prompt_logprobs=2)
    plain, _ = run(target, None, prompts, params)
    llm = LLM(target, drafter, num_speculative_tokens=7, **SETTINGS)
    oracle = OracleDrafter(llm, {tuple(p): p + out.outputs[0].token_ids for p, out in zip(prompts, plain)})
    speculative = llm.generate(prompts, params)
    assert llm.stats.mean_acceptance_length > 2.0 and oracle.expected_accepted > 0
    llm.close()
    for a, b in zip(plain, speculative):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        entries = [out.outputs[0].logprobs + out.prompt_logprobs[1:] for out in (a, b)]
        for x, y in zip(*entries):
            assert x.token_id == y.token_id and x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-5)


def test_prompt_logprobs_recompute_a_prefix_cache_hit_and_leave_its_pages_as_they_were(tmp_path, seed):
    """A prompt-logprob request whose prefix is cached gets every prompt logprob (the cached positions
    run again for their logits) while a request beside it, served from the same cached pages, and the
    first request run again decode exactly what they decode without the cache."""
    target, drafter = make_pair(tmp_path)
    shared = prompt(40)
    first, asking, beside = shared + prompt(5), shared + prompt(7), shared + prompt(3)
    expected, _ = run(target, drafter, [first, beside], greedy(12), num_speculative_tokens=3,
                      enable_prefix_caching=False)
    llm = LLM(target, drafter, num_speculative_tokens=3, **SETTINGS)
    assert llm.generate([first], greedy(12))[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    hits = llm.engine.pool_usage().prefix_cache_hits
    second = llm.generate([asking, beside], [greedy(12, logprobs=1, prompt_logprobs=1), greedy(12)])
    assert llm.engine.pool_usage().prefix_cache_hits > hits  # both hit the cached prefix
    assert second[1].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert llm.generate([first], greedy(12))[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    usage = llm.engine.pool_usage()
    assert usage.num_used_blocks == 0 and usage.num_seqs == 0
    llm.close()
    assert_matches_hf(HFTarget(target), second[0], 1, 1)


@pytest.mark.parametrize("fields", [dict(temperature=0.8, top_k=12, top_p=0.9),
                                    dict(temperature=1.4, top_p=0.7), dict(temperature=0)])
def test_processed_logprobs_are_the_samplers_distribution_over_the_targets_logits(tmp_path, seed, fields):
    target, drafter = make_pair(tmp_path)
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=seed, logprobs=4, logprobs_mode="processed",
                            **fields)
    out = run(target, drafter, [prompt(9)], params, num_speculative_tokens=3)[0][0]
    tokens = out.outputs[0].token_ids
    logits = HFTarget(target).logits(out.prompt_token_ids + tokens)[len(out.prompt_token_ids) - 1:]
    for j, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        if params.greedy:  # one-hot on the argmax
            assert entry.logprob == 0.0 and entry.top_logprobs[1:] == (float("-inf"),) * 3
            continue
        expected = processed_oracle(logits[j: j + 1], params)[0]
        assert float(expected[token]) > float("-inf")  # the sampled token is one the filters keep
        assert entry.token_id == token and entry.logprob == pytest.approx(float(expected[token]), abs=ATOL)
        kept = sorted(expected[expected > float("-inf")].tolist(), reverse=True)[:4]
        assert entry.top_logprobs[: len(kept)] == pytest.approx(kept, abs=ATOL)
        assert all(value == float("-inf") for value in entry.top_logprobs[len(kept):])


def test_a_request_that_asks_for_logprobs_changes_no_other_requests_tokens(tmp_path, seed):
    """The same batch twice, its first request asking for logprobs (processed, and its prompt's) the
    second time: every request decodes the same tokens (the sampled ones with their own seeds)."""
    target, drafter = make_pair(tmp_path)
    prompts = [prompt(n) for n in (20, 6, 33, 12)]
    others = [greedy(16), SamplingParams(max_tokens=16, temperature=1.0, seed=seed + 1, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=seed + 2, ignore_eos=True)]
    quiet = SamplingParams(max_tokens=16, temperature=0.9, seed=seed, ignore_eos=True)
    asking = quiet.model_copy(update=dict(logprobs=3, prompt_logprobs=2, logprobs_mode="processed"))
    without, _ = run(target, drafter, prompts, [quiet, *others], num_speculative_tokens=3)
    beside, _ = run(target, drafter, prompts, [asking, *others], num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in beside] == [o.outputs[0].token_ids for o in without]
    assert all(o.outputs[0].logprobs is None and o.prompt_logprobs is None for o in beside[1:])
    assert len(beside[0].outputs[0].logprobs) == 16 and len(beside[0].prompt_logprobs) == 20


def test_preempted_requests_keep_their_logprobs_and_recompute_only_what_is_missing(tmp_path, seed):
    """A pool of 12 blocks for six requests of up to 5: some are preempted (recompute), mid-prefill
    or mid-decode, with a budget that prefills in chunks; every logprob still equals HF's."""
    target, drafter = make_pair(tmp_path)
    prompts = [prompt(int(n)) for n in torch.randint(20, 40, (6,))]
    params = greedy(40, logprobs=2, prompt_logprobs=1)
    spec_bytes = 16 * (2 * 4 * 2 * 16 * 4 + 2 * 2 * 2 * 16 * 4)  # a block: the target's and the draft's K/V
    llm = LLM(target, drafter, num_speculative_tokens=5, max_num_seqs=6, kv_cache_memory=12 * spec_bytes,
              tokens_per_block=16, max_model_len=128, max_num_batched_tokens=24)
    assert llm.engine.pool_limits.num_blocks == 12
    outputs = llm.generate(prompts, params)
    assert llm.engine.counters().num_preemptions > 0
    llm.close()
    hf = HFTarget(target)
    for out in outputs:
        assert len(out.outputs[0].token_ids) == 40
        assert_matches_hf(hf, out, 2, 1)


@pytest.mark.gpu
def test_on_a_gpu_graph_replays_give_the_eager_steps_logprobs_and_hf_s_within_tf32(tmp_path, seed):
    """The steady state replays CUDA graphs, which return logits; the logprobs are gathered from those
    outside the graph, and equal the eager steps' (the same kernels at these lengths) and HF's within
    the TF32 rounding of the attention kernels' fp32 dots (on a logit and on the logsumexp)."""
    from near_ties import TF32_LOGPROB

    target, drafter = make_pair(tmp_path)
    prompts = [prompt(n) for n in (5, 30, 17, 60, 9)]  # 5 sequences: graphs of 8 with 3 dummies
    params = greedy(24, logprobs=5, prompt_logprobs=2)
    cuda = dict(SETTINGS, device="cuda", dtype="float32", kv_cache_memory="64MiB", num_speculative_tokens=3)
    outputs = {}
    for eager in (True, False):
        llm = LLM(target, drafter, enforce_eager=eager, **cuda)
        outputs[eager] = llm.generate(prompts, params)
        if not eager:
            assert llm.assembly.runner.graphs.replays > 0
        llm.close()
    hf = HFTarget(target)
    for a, b in zip(outputs[True], outputs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        entries = [out.outputs[0].logprobs + out.prompt_logprobs[1:] for out in (a, b)]
        for x, y in zip(*entries):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-5
        assert_matches_hf(hf, b, 5, 2, atol=TF32_LOGPROB)
