"""No request can hurt another: a failure in one sequence's part of a step (its sampling, its stop
check, its detokenisation when streamed) ends that request alone with finish_reason "error" and frees
its pages, while every other sequence of the batch decodes exactly the tokens it decodes without the
poisoned one (the oracle: the same greedy prompts run without it). A failure of the device itself
still ends the step. Requests at every sampling extreme run beside greedy ones and never fail.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import make_pair, random_prompts
from near_ties import TF32_TIE, assert_equal_up_to_a_near_tie

import target_service.runner.model_runner as model_runner
from target_service.engine.async_engine import AsyncEngine
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.stop_checker import StopChecker
from target_service.llm import LLM

POISON_SEED = 424242  # the sampled request whose sampling the tests make fail
CPU = dict(kv_cache_memory="4MiB")
CUDA = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB")


def settings(device_settings: dict, **fields) -> dict:
    return dict(num_speculative_tokens=3, tokens_per_block=16, max_num_seqs=8, max_model_len=128,
                **device_settings, **fields)


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


POISONED = SamplingParams(max_tokens=40, temperature=1.0, seed=POISON_SEED, ignore_eos=True)


def poison_sampling(monkeypatch, *, after: int, error: type[BaseException] = RuntimeError) -> dict:
    """Make the POISON_SEED request's sampling raise from its (after + 1)-th call on; returns the
    call count (the other requests are greedy and never sample)."""
    real, calls = model_runner.choose_tokens, {"poisoned": 0}

    def choose_tokens(logits, params, generator=None):
        if params.seed == POISON_SEED:
            calls["poisoned"] += 1
            if calls["poisoned"] > after:
                raise error("poisoned sampling")
        return real(logits, params, generator)

    monkeypatch.setattr(model_runner, "choose_tokens", choose_tokens)
    return calls


def assert_no_page_in_use(llm: LLM) -> None:
    usage = llm.engine.pool_usage()
    assert usage.num_used_blocks == 0 and usage.num_seqs == 0 and llm.engine.num_requests == 0


def greedy_tokens(target, drafter, prompts, device_settings, **fields) -> list[list[int]]:
    llm = LLM(target, drafter, **settings(device_settings, **fields))
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy())]
    llm.close()
    return tokens


def assert_same_tokens(target, prompts, got, expected, *, exact: bool) -> None:
    for prompt, ours, reference in zip(prompts, got, expected):
        if exact:
            assert ours == reference
        else:  # on a GPU, a batch of another size may part at a near-tie, correctly
            assert_equal_up_to_a_near_tie(target, prompt, ours, reference, TF32_TIE)


def check_sampling_failure_is_isolated(tmp_path, monkeypatch, device_settings, *, async_scheduling: bool,
                                       exact: bool) -> None:
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(4, 160)
    expected = greedy_tokens(target, drafter, prompts, device_settings, async_scheduling=async_scheduling)
    calls = poison_sampling(monkeypatch, after=3)  # it runs a few steps first, then fails mid-batch
    llm = LLM(target, drafter, **settings(device_settings, async_scheduling=async_scheduling))
    poison_prompt = random_prompts(1, 160)[0]
    outputs = llm.generate([*prompts[:2], poison_prompt, *prompts[2:]],
                           [greedy(), greedy(), POISONED, greedy(), greedy()])
    poisoned = outputs.pop(2).outputs[0]
    assert calls["poisoned"] > 3 and poisoned.finish_reason == "error"
    assert 1 <= len(poisoned.token_ids) < POISONED.max_tokens  # it failed while running
    assert [out.outputs[0].finish_reason for out in outputs] == ["length"] * 4
    assert_same_tokens(target, prompts, [out.outputs[0].token_ids for out in outputs], expected, exact=exact)
    assert llm.stats.num_drafts > 0
    if async_scheduling:
        assert llm.engine.counters().num_steps_ahead > 0  # steps launched ahead ran beside the failure
    assert_no_page_in_use(llm)
    again = llm.generate(prompts[:1], greedy())[0].outputs[0]  # the engine serves on
    assert_same_tokens(target, prompts[:1], [again.token_ids], expected[:1], exact=exact)
    llm.close()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failing_sampling_fails_its_request_alone(tmp_path, monkeypatch, async_scheduling):
    check_sampling_failure_is_isolated(tmp_path, monkeypatch, CPU, async_scheduling=async_scheduling,
                                       exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failing_sampling_fails_its_request_alone_on_cuda(tmp_path, monkeypatch, async_scheduling):
    check_sampling_failure_is_isolated(tmp_path, monkeypatch, CUDA, async_scheduling=async_scheduling,
                                       exact=False)


def test_a_failing_stop_check_fails_its_request_alone(tmp_path, monkeypatch):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(3, 160)
    expected = greedy_tokens(target, drafter, prompts, CPU)
    poison_prompt = random_prompts(1, 160, low=10, high=20)[0]
    real = StopChecker.check

    def check(self, seq, max_model_len):
        if seq.prompt_token_ids == poison_prompt and len(seq.output_token_ids) >= 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned detokenisation")
        return real(self, seq, max_model_len)

    monkeypatch.setattr(StopChecker, "check", check)
    llm = LLM(target, drafter, **settings(CPU))
    outputs = llm.generate([poison_prompt, *prompts], greedy())
    poisoned = outputs.pop(0).outputs[0]
    assert poisoned.finish_reason == "error" and len(poisoned.token_ids) == 5
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert_no_page_in_use(llm)
    llm.close()


def test_a_device_failure_still_ends_the_step(tmp_path, monkeypatch):
    """Running out of device memory is no one request's fault: the error leaves `step` as before."""
    target, drafter = make_pair(tmp_path)
    poison_sampling(monkeypatch, after=1, error=torch.cuda.OutOfMemoryError)
    llm = LLM(target, drafter, **settings(CPU))
    with pytest.raises(torch.cuda.OutOfMemoryError, match="poisoned"):
        llm.generate([*random_prompts(2, 160), [5, 6, 7]], [greedy(), greedy(), POISONED])
    llm.close()


def test_a_failed_request_ends_its_stream_while_the_others_stream_on(tmp_path, monkeypatch):
    """One request fails in the engine (its sampling), one in the stream's own detokenisation; each
    stream ends with a finished "error" delta, and the others equal the offline run without them."""
    target, drafter = make_pair(tmp_path, tokenizer=True)
    prompts = random_prompts(3, 160)
    offline = LLM(target, drafter, **settings(CPU))
    expected = [out.outputs[0] for out in offline.generate(prompts, greedy())]
    offline.close()
    poison_sampling(monkeypatch, after=2)
    llm = LLM(target, drafter, **settings(CPU))
    engine = AsyncEngine(llm.engine)
    undecodable = random_prompts(1, 160, low=10, high=20)[0]
    output_text = llm.engine.output_text

    def poisoned_output_text(seq):
        if seq.prompt_token_ids == undecodable and len(seq.output_token_ids) >= 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned detokenisation")
        return output_text(seq)

    monkeypatch.setattr(llm.engine, "output_text", poisoned_output_text)

    async def collect(prompt, params):
        return [delta async for delta in engine.generate(prompt, params)]

    async def main():
        jobs = [collect(prompt, greedy()) for prompt in prompts]
        jobs += [collect([5, 6, 7, 8], POISONED), collect(undecodable, greedy(max_tokens=40))]
        return await asyncio.gather(*jobs)

    *streams, sampled, undecoded = asyncio.run(main())
    for deltas in (sampled, undecoded):
        assert deltas[-1].finished and deltas[-1].finish_reason == "error"
        assert not any(delta.finished for delta in deltas[:-1])
        assert 1 <= deltas[-1].num_output_tokens < 40
    for deltas, want in zip(streams, expected):
        assert [token for delta in deltas for token in delta.token_ids] == want.token_ids
        assert "".join(delta.text for delta in deltas) == want.text
        assert deltas[-1].finish_reason == "length"
    assert engine.is_healthy
    assert_no_page_in_use(llm)
    assert asyncio.run(collect(prompts[0], greedy()))[-1].finish_reason == "length"  # serving on
    engine.shutdown()
    llm.close()


# ---- the extremes, end to end ---------------------------------------------------------------------

ARGMAX_EQUIVALENT = [  # each keeps only the most likely token: the greedy tokens, exactly
    SamplingParams(max_tokens=24, top_p=1e-46, ignore_eos=True),
    SamplingParams(max_tokens=24, top_p=5e-324, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=24, top_k=1, temperature=1e30, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1e-30, ignore_eos=True),
]
SAMPLED = [  # computed safely: they run to max_tokens, the seeded ones reproducibly
    SamplingParams(max_tokens=24, temperature=1e30, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1e-5, top_k=2**70, seed=0, ignore_eos=True),
    SamplingParams(max_tokens=24, top_p=1 - 1e-16, seed=2**63 - 1, ignore_eos=True),
    SamplingParams(max_tokens=24, top_p=0.5, top_k=3, seed=-(2**63), ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=7.0, seed=-1, ignore_eos=True),
]


def check_extremes_run_beside_greedy(tmp_path, device_settings, *, exact: bool) -> None:
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(len(ARGMAX_EQUIVALENT) + len(SAMPLED) + 2, 160)
    llm = LLM(target, drafter, **settings(device_settings))
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy())]
    params = ARGMAX_EQUIVALENT + SAMPLED + [greedy(), greedy()]
    runs = [[out.outputs[0] for out in llm.generate(prompts, params)] for _ in range(2)]
    for outputs in runs:
        assert [out.finish_reason for out in outputs] == ["length"] * len(prompts)
        argmax_like = [out.token_ids for i, out in enumerate(outputs) if i < len(ARGMAX_EQUIVALENT)]
        assert_same_tokens(target, prompts, argmax_like, expected, exact=exact)
        greedy_ones = [out.token_ids for out in outputs[-2:]]
        assert_same_tokens(target, prompts[-2:], greedy_ones, expected[-2:], exact=exact)
    seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
    assert [runs[0][i].token_ids for i in seeded] == [runs[1][i].token_ids for i in seeded]
    assert_no_page_in_use(llm)
    llm.close()


def test_requests_at_every_sampling_extreme_run_beside_greedy_ones(tmp_path):
    check_extremes_run_beside_greedy(tmp_path, CPU, exact=True)


@pytest.mark.gpu
def test_requests_at_every_sampling_extreme_run_beside_greedy_ones_on_cuda(tmp_path):
    check_extremes_run_beside_greedy(tmp_path, CUDA, exact=False)
