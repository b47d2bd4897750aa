"""The near-tie oracle refuses a real mismatch and accepts equal outputs (its GPU use: test_engine_gpu)."""

import pytest
from engine_helpers import make_pair, random_prompts
from near_ties import assert_equal_up_to_a_near_tie, first_difference

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_equal_outputs_pass_and_a_token_that_is_not_the_runner_up_fails(tmp_path):
    target, _ = make_pair(tmp_path)
    prompt = random_prompts(1, 160)[0]
    llm = LLM(target, kv_cache_memory="4MiB", tokens_per_block=16)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].outputs[0]
    llm.close()
    ids = expected.token_ids
    assert_equal_up_to_a_near_tie(target, prompt, list(ids), list(ids))
    wrong = list(ids)
    wrong[3] = (wrong[3] + 1) % 160  # a token the target did not choose: a gap far above 1e-4, or not top-2
    with pytest.raises(AssertionError, match="outputs part at token 3"):
        assert_equal_up_to_a_near_tie(target, prompt, wrong, list(ids))
