"""bench.hybrid_replay against the engine it stands in for, on a tiny random pair.

Oracles: the engine itself. The recorded DFlash proposal at each position equals what the serving
drafter proposed there in a DFlash-only engine (the dense training forward and the paged serving
path compute the same drafter); the recorded output is the engine's greedy output; replayed ngram and
DFlash decode in as many steps, accepting as many drafts, as those engines did for each request.
"""

import pytest
import torch
from engine_helpers import PositionRecorder, make_pair

from bench.hybrid_replay import Replayer, record
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

MAX_TOKENS, VOCAB = 16, 160


def _prompts() -> list[list[int]]:
    """A random prompt, one that repeats a phrase (the lookup matches), and one in between."""
    phrase = torch.randint(3, VOCAB, (6,)).tolist()
    noise = torch.randint(3, VOCAB, (12,)).tolist()
    return [noise, phrase * 3 + phrase[:2], noise[:5] + phrase + noise[5:] + phrase[:3]]


@pytest.fixture(scope="module")
def pair_and_recording(tmp_path_factory):
    target, drafter = make_pair(tmp_path_factory.mktemp("pair"))
    prompts = _prompts()
    return target, drafter, prompts, record({"mixed": prompts}, MAX_TOKENS, target, drafter)["mixed"]


def _engine(target, drafter, method: str) -> LLM:
    return LLM(str(target), None if method == "ngram" else str(drafter), speculative_method=method,
               device="cpu", dtype="float32", max_num_seqs=1, max_model_len=256, kv_cache_memory="64MiB")


def test_recorded_dflash_proposals_are_the_serving_drafters(pair_and_recording):
    target, drafter, prompts, recorded = pair_and_recording
    llm = _engine(target, drafter, "dflash")
    runner = llm.assembly.runner
    recorder = PositionRecorder(runner.drafter, runner.step_buffers, llm.engine)
    runner.swap_drafter(recorder)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    try:
        outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
    finally:
        llm.close()
    compared = 0
    for prompt, output, replay in zip(prompts, outputs, recorded):
        assert list(output.outputs[0].token_ids) == replay.output
        for (key, start), proposal in recorder.proposals.items():
            if key != tuple(prompt):
                continue
            if start not in replay.dflash:  # a step launched ahead past the request's end, then dropped
                assert start >= len(replay.tokens) - 1, start
                continue
            assert replay.dflash[start][:len(proposal)] == proposal, start
            compared += 1
    assert compared >= len(prompts)


@pytest.mark.parametrize("method", ["ngram", "dflash"])
def test_replayed_steps_and_acceptance_are_the_engines(pair_and_recording, method):
    target, drafter, prompts, recorded = pair_and_recording
    llm = _engine(target, drafter, method)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    num_draft = llm.assembly.runner.drafter.block_size - 1
    replayer = Replayer(method, 0.5, num_draft, 1)
    try:
        for prompt, replay in zip(prompts, recorded):
            stats = llm.generate([prompt], params)[0].spec_decode
            replayed = replayer.decode([replay])
            assert (replayed["drafts"], replayed["accepted"]) == (stats.num_drafts, stats.num_accepted_tokens)
    finally:
        llm.close()
