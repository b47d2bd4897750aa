"""When requests end (stop strings, stop token ids, EOS, max_tokens, max_model_len), what is refused
at submission, and that no page stays in use afterwards. The oracle is a target-only greedy run."""

import json

import pytest
import torch
from engine_helpers import make_pair, random_prompts

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

pytestmark = pytest.mark.usefixtures("pool_transport")


def greedy(**fields):
    return SamplingParams(temperature=0, **{"max_tokens": 30, "ignore_eos": True, **fields})


@pytest.fixture
def pair(tmp_path):
    return make_pair(tmp_path, tokenizer=True)


def speculative(target, drafter, **kwargs):
    fields = dict(num_speculative_tokens=3, kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=8,
                  max_model_len=96)
    return LLM(target, drafter, **{**fields, **kwargs})


def reference(target, prompt):
    llm = LLM(target, kv_cache_memory="4MiB", tokens_per_block=16, max_model_len=96)
    ids = llm.generate([prompt], greedy())[0].outputs[0].token_ids
    llm.close()
    return ids


def stop_case(target):
    """(prompt, reference ids, i): token i does not occur before i, so stopping on it stops exactly
    there, and it is an ordinary word (ids 0..2 are the tokenizer's <unk>, <s>, </s>); config.json's
    EOS (2) does not occur before it either. Random models often loop on one token, so draw prompts
    until one has such an i >= 1."""
    for _ in range(20):
        prompt = random_prompts(1, 160)[0]
        ids = reference(target, prompt)
        found = [i for i in range(1, len(ids)) if ids[i] not in ids[:i] and ids[i] > 2 and 2 not in ids[:i]]
        if found:
            return prompt, ids, found[-1]
    raise AssertionError("no prompt gave a usable reference")


def test_stop_token_id_ends_at_its_first_occurrence(pair):
    target, drafter = pair
    prompt, ids, i = stop_case(target)
    llm = speculative(target, drafter)
    out = llm.generate([prompt], greedy(stop_token_ids=[ids[i]]))[0].outputs[0]
    assert out.token_ids == ids[: i + 1] and out.finish_reason == "stop"
    llm.close()


def test_eos_from_generation_config_ends_unless_ignored(pair):
    target, drafter = pair
    prompt, ids, i = stop_case(target)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[i]]}))
    llm = speculative(target, drafter)
    out = llm.generate([prompt], greedy(ignore_eos=False))[0].outputs[0]
    assert out.token_ids == ids[: i + 1] and out.finish_reason == "stop"
    assert f"w{ids[i]}" not in out.text.split()[-1:]  # the EOS token is not part of the text
    ignored = llm.generate([prompt], greedy(ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == ids and ignored.finish_reason == "length"
    llm.close()


def test_stop_string_cuts_the_text_before_it(pair):
    target, drafter = pair
    llm = speculative(target, drafter)
    for _ in range(20):  # a word that is not a substring of the text before it ("w14" is in "w149")
        prompt, ids, _ = stop_case(target)
        words = [llm.tokenizer.id_to_token(t) for t in ids]  # vocabulary lookup, not the decoder
        found = [i for i in range(1, len(ids)) if ids[i] > 2 and words[i] not in " ".join(words[:i])]
        if found:
            break
    i = found[-1]
    out = llm.generate([prompt], greedy(stop=[words[i]]))[0].outputs[0]
    assert out.token_ids == ids[: i + 1] and out.finish_reason == "stop"
    assert out.text == " ".join(words[:i]) + " "
    llm.close()


def test_max_tokens_and_max_model_len(pair):
    target, drafter = pair
    prompt = random_prompts(1, 160, low=10, high=11)[0]
    ids = reference(target, prompt)
    llm = speculative(target, drafter)
    out = llm.generate([prompt], greedy(max_tokens=7))[0].outputs[0]
    assert out.token_ids == ids[:7] and out.finish_reason == "length"
    short = speculative(target, drafter, max_model_len=len(prompt) + 5)
    out = short.generate([prompt], greedy(max_tokens=30))[0].outputs[0]
    assert out.token_ids == ids[:5] and out.finish_reason == "length"  # prompt + output = max_model_len
    for engine in (llm, short):
        assert engine.engine.pool_usage().num_used_blocks == 0
        engine.close()


def test_strings_are_tokenized_and_outputs_detokenized(pair):
    target, drafter = pair
    llm = speculative(target, drafter)
    out = llm.generate("w5 w9 w17", greedy(max_tokens=4))[0]
    assert out.prompt_token_ids == [5, 9, 17] and out.prompt == "w5 w9 w17"
    words = [llm.tokenizer.id_to_token(t) for t in out.outputs[0].token_ids]  # vocabulary lookup
    assert out.outputs[0].text == " ".join(words)
    llm.close()


@pytest.mark.parametrize(
    "prompt,words",
    [([], "empty"), ([5, 999], "outside the vocabulary"), ([5] * 96, "max_model_len")],
)
def test_bad_prompts_are_refused_before_anything_runs(pair, prompt, words):
    target, drafter = pair
    llm = speculative(target, drafter)
    with pytest.raises(ValueError, match=words):
        llm.generate([[7, 8, 9], prompt], greedy())
    assert not llm.engine.has_unfinished and llm.stats.num_drafts == 0  # the good prompt did not run
    llm.close()


def test_a_request_too_big_for_the_whole_pool_is_refused_at_submission(pair):
    target, drafter = pair
    # 6 blocks of 16 tokens: 40 prompt tokens + 100 new tokens can never fit, even alone
    llm = speculative(target, drafter, kv_cache_memory=6 * 16 * (1024 + 512), max_model_len=256)
    assert llm.engine.pool_limits.num_blocks == 6
    with pytest.raises(ValueError, match="needs up to 9 blocks"):
        llm.generate([[5] * 40], greedy(max_tokens=100))
    assert len(llm.generate([[5] * 40], greedy(max_tokens=40))[0].outputs[0].token_ids) == 40
    llm.close()


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(num_speculative_tokens=8), "block_size - 1"),
        (dict(context_storage="ring"), "context_storage"),
        (dict(kv_cache_memory="1KiB"), "blocks"),
        (dict(kv_cache_memory="lots"), "size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
    ],
)
def test_bad_engine_settings_are_named(pair, kwargs, words):
    target, drafter = pair
    with pytest.raises(ValueError, match=words):
        speculative(target, drafter, **kwargs)


def test_token_prompts_work_without_a_tokenizer(tmp_path):
    target, drafter = make_pair(tmp_path, tokenizer=False)
    llm = speculative(target, drafter)
    assert len(llm.generate([[4, 5, 6]], greedy(max_tokens=3))[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", greedy())
    llm.close()


def test_no_page_in_use_after_a_mixed_batch_ends(pair):
    target, drafter = pair
    llm = speculative(target, drafter)
    prompts = random_prompts(5, 160)
    params = [greedy(max_tokens=int(n)) for n in torch.randint(1, 20, (5,))]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    usage = llm.engine.pool_usage()
    assert usage.num_used_blocks == 0 and usage.num_seqs == 0
    llm.close()


def test_an_aborted_request_frees_its_pages_at_once_and_the_others_run_on(pair):
    target, drafter = pair
    prompts = random_prompts(3, 160, low=10, high=30)
    expected = [reference(target, prompt) for prompt in prompts]
    llm = speculative(target, drafter)
    engine = llm.engine
    seqs = [engine.add_request(f"r{i}", prompt, greedy()) for i, prompt in enumerate(prompts)]
    waiting = engine.add_request("waiting", prompts[0], greedy())
    while len(seqs[1].output_token_ids) < 3:
        engine.step()
    used = engine.pool_usage().num_used_blocks
    aborted = engine.abort("r1")
    done = aborted.output_token_ids
    assert aborted.finish_reason == "abort" and len(done) >= 3 and done == expected[1][:len(done)]
    assert engine.pool_usage().num_used_blocks == used - len(aborted.block_table)
    engine.abort("waiting")  # never admitted, or admitted: either way it is gone
    assert waiting.is_finished and not engine.has_request("waiting")
    while engine.has_unfinished:
        engine.step()
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == [expected[0], expected[2]]
    assert engine.pool_usage().num_used_blocks == 0
    with pytest.raises(ValueError, match="request id 'r1' is not in the engine"):
        engine.abort("r1")
    llm.close()
