"""bench.bench_proposers' measuring core on a tiny random pair: two prompts per class, 8 tokens.

Oracles: every method's outputs equal plain greedy decoding (the bench's lossless counts are full);
the acceptance it reports for each prompt equals 1 + accepted / drafts of a separate engine's
RequestOutput for that prompt alone; the hybrid's ngram share is a fraction of the rows it drafted,
each request's rows at least its verified drafts, and its choosing cost was measured over steps it
actually took, split into the lookup's part and deciding, beside the runner's context work.
"""

import time

import pytest
import torch
from engine_helpers import make_pair, random_prompts

from bench.bench_proposers import METHODS, MODES, measure
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

MAX_TOKENS, ROUNDS, VOCAB = 8, 1, 160


def classes() -> dict[str, list[list[int]]]:
    phrase = [torch.randint(3, VOCAB, (5,)).tolist() for _ in range(2)]
    return {"code": random_prompts(2, VOCAB, low=8, high=20),
            "repeats": [p * 3 + p[:2] for p in phrase],
            "edits": [[*p, 7, *p[:1]] for p in random_prompts(2, VOCAB, low=8, high=20)]}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    target, drafter = make_pair(tmp_path_factory.mktemp("pair"))
    prompts = classes()
    record = measure(str(target), str(drafter), prompts, max_tokens=MAX_TOKENS, rounds=ROUNDS,
                     device="cpu", dtype="float32")
    return str(target), str(drafter), prompts, record


def test_every_method_is_lossless_and_every_run_counted(measured):
    _, _, prompts, record = measured
    for name, cls in record["classes"].items():
        for mode in MODES:
            for method in ("plain", *METHODS):
                row = cls[mode][method]
                assert row["outputs"] == len(prompts[name]) * (ROUNDS + 1), (name, mode, method)
                assert row["lossless"] == row["outputs"], (name, mode, method)


def test_reported_acceptance_is_one_plus_accepted_over_drafts_of_the_request(measured):
    """DFlash and ngram are deterministic: a second run of the prompt drafts the same and gives the
    reported acceptance. The hybrid chooses from step times it measures, so a rerun may choose
    otherwise: its acceptance is checked against the counters its own run recorded."""
    target, drafter, prompts, record = measured
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for cls in record["classes"].values():
        row = cls["batch1"]["hybrid"]
        counters = zip(row["acceptance"], row["num_drafts"], row["num_accepted_tokens"])
        for reported, drafts, accepted in counters:
            assert drafts > 0 and reported == pytest.approx(1 + accepted / drafts)
    for method in [method for method in METHODS if method != "hybrid"]:
        llm = LLM(target, None if method == "ngram" else drafter, speculative_method=method,
                  num_speculative_tokens=record["num_speculative_tokens"], device="cpu", dtype="float32",
                  kv_cache_memory="16MiB", max_model_len=128)
        try:
            for name, cls in record["classes"].items():
                for i, prompt in enumerate(prompts[name]):
                    stats = llm.generate([prompt], params)[0].spec_decode
                    assert stats.num_drafts > 0
                    expected = 1 + stats.num_accepted_tokens / stats.num_drafts
                    reported = cls["batch1"][method]["acceptance"][i]
                    assert reported == pytest.approx(expected), (method, name, i)
        finally:
            llm.close()


def test_ngram_share_is_a_fraction_and_choosing_was_timed_over_real_steps(measured):
    *_, record = measured
    for cls in record["classes"].values():
        for mode in MODES:
            hybrid = cls[mode]["hybrid"]
            assert 0.0 <= hybrid["ngram_share"] <= 1.0
            assert all(0.0 <= share <= 1.0 for share in hybrid["ngram_share_per_prompt"])
            for (lookup, drafted), drafts in zip(hybrid["rows_per_prompt"], hybrid["num_drafts"]):
                assert 0 <= lookup <= drafted and drafted >= drafts > 0  # every verified draft was a row
            assert hybrid["steps_timed"] > 0 and hybrid["choose_us_per_step"] > 0
            # the parts: the lookup's share of choosing (inside it, so deciding is what is left, >= 0)
            # and the runner's context work, which every step with taps does
            assert hybrid["lookup_us_per_step"] > 0 and hybrid["deciding_us_per_step"] >= 0
            assert hybrid["staging_us_per_step"] >= 0
            parts = sum(hybrid[f"{part}_us_per_step"] for part in ("lookup", "staging", "deciding"))
            assert parts == pytest.approx(hybrid["choose_us_per_step"])
            assert hybrid["context_us_per_step"] > 0 and hybrid["context_dflash_us_per_step"] >= 0
    assert set(record["goals"]) == {f"{name}/{mode}" for name in record["classes"] for mode in MODES}


def test_the_meter_wraps_the_hybrid_only_inside_its_block(tmp_path):
    """The timed rounds run the hybrid as ngram and DFlash run, unwrapped: outside `attached` its
    proposer and runner answer with their classes' own methods and a generate counts nothing; inside,
    every step is counted."""
    from bench.bench_proposers import ChoiceMeter, run_once

    target, drafter = make_pair(tmp_path)
    llm = LLM(str(target), str(drafter), speculative_method="hybrid", device="cpu", dtype="float32",
              kv_cache_memory="16MiB", max_model_len=128)
    try:
        runner = llm.assembly.runner
        proposer = runner.drafter
        wrapped = [(proposer, "propose"), (proposer, "_write"), (proposer.dflash, "propose"),
                   (proposer.dflash, "store_context"), (proposer.dflash, "settle"),
                   (proposer.lookups, "propose"), (proposer.deferred, "stage"), (runner, "_store_context")]

        def own_methods() -> list[bool]:  # whether each wrapped call is the class's method again
            return [getattr(getattr(owner, name), "__func__", None) is getattr(type(owner), name)
                    for owner, name in wrapped]

        assert all(own_methods())
        meter = ChoiceMeter(llm, time.perf_counter)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        prompt = random_prompts(1, VOCAB, low=8, high=20)[0]
        with meter.attached():
            assert not any(own_methods())
        assert all(own_methods())  # nothing of the meter left behind
        unmetered = run_once(llm, [prompt], params, time.perf_counter, None)
        assert meter.steps == 0 and "steps" not in unmetered
        metered = run_once(llm, [prompt], params, time.perf_counter, meter)
        assert metered["steps"] > 0 and metered["tokens"] == unmetered["tokens"]
        assert all(own_methods())
    finally:
        llm.close()
