"""bench.hybrid_overhead's pinned engine: the hybrid with its choice pinned to the lookup drafts what
ngram drafts (equal outputs and per-request counters on fresh random prompts), never runs the DFlash
drafter, and still stores the drafter's context; the step counter counts the runner's launches."""

import torch
from engine_helpers import make_pair, random_prompts

from bench.hybrid_overhead import count_steps
from dflash_cli.bench.proposer_modes import pin_to_lookup
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

SETTINGS = dict(device="cpu", dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
                num_speculative_tokens=5)


def test_the_pinned_hybrid_drafts_as_ngram_does_and_keeps_the_context(tmp_path):
    target, drafter = make_pair(tmp_path)
    phrase = torch.randint(3, 160, (4,)).tolist()
    prompts = [*random_prompts(2, 160, low=8, high=20), phrase * 4]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ngram = LLM(str(target), None, speculative_method="ngram", **SETTINGS)
    pinned = LLM(str(target), str(drafter), speculative_method="hybrid", **SETTINGS)
    try:
        pin_to_lookup(pinned)
        proposer = pinned.assembly.runner.drafter
        calls = {"propose": 0, "store_context": 0}
        for name in calls:
            inner = getattr(proposer.dflash, name)

            def counted(*args, inner=inner, name=name):
                calls[name] += 1
                return inner(*args)
            setattr(proposer.dflash, name, counted)
        steps = count_steps(pinned)
        expected = ngram.generate(prompts, params)
        got = pinned.generate(prompts, params)
    finally:
        ngram.close()
        pinned.close()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [(o.spec_decode.num_drafts, o.spec_decode.num_accepted_tokens) for o in got] == \
        [(o.spec_decode.num_drafts, o.spec_decode.num_accepted_tokens) for o in expected]
    assert calls["propose"] == 0 and calls["store_context"] > 0
    assert steps[0] >= max(o.spec_decode.num_drafts for o in got) + 1  # a prefill, then a step per draft
