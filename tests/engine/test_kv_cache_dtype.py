"""An fp8 target K/V cache (kv_cache_dtype="fp8"): its pages, its pool, and speculation over it.

The pages are checked against the full-precision engine's own pages rounded to float8 e4m3 (layer 0,
whose K/V come from the embeddings alone, so nothing upstream differs), the pool against the bytes
per token worked out by hand, and DFlash over the fp8 cache against plain decoding over it (the
speculation stays lossless with respect to the target it runs, here the fp8-cache one).
"""

import pytest
import torch
from engine_helpers import make_pair, random_prompts

from target_service.assembly.engine_args import EngineArgs
from target_service.assembly.plan import resolve_plan
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

# on CPU wherever the test is run (on a GPU a verify and a decode may part at a near-tie; the page test
# below takes its device as a parameter)
SETTINGS = dict(kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=8, max_model_len=160, device="cpu")
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # cuda: in-kernel
def test_fp8_pages_hold_the_full_precision_pages_rounded_to_fp8(tmp_path, device):
    target, _ = make_pair(tmp_path)
    prompt = random_prompts(1, 160, low=20, high=60)
    arenas = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(target, None, kv_cache_dtype=dtype, enable_prefix_caching=False,
                  **{**SETTINGS, "device": device, "dtype": "float32"})
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))  # the prompt's K/V only
        layer = llm.assembly.runner.target_caches[0]
        arenas[dtype] = (layer.k_cache.clone(), layer.v_cache.clone(), layer.k_scale)
        llm.close()
    k, v, no_scale = arenas["auto"]
    k8, v8, scale = arenas["fp8"]
    assert no_scale is None and k8.dtype == FP8 and float(scale) == 1.0
    blocks = min(k.shape[0], k8.shape[0])  # the fp8 pool has more pages; the prompt uses the first few
    assert k[:blocks].abs().sum() > 0  # the prompt was stored
    for full, rounded in ((k, k8), (v, v8)):
        bits = [pages[:blocks].view(torch.uint8).cpu() for pages in (full.to(FP8), rounded)]
        assert torch.equal(*bits)


@pytest.mark.parametrize("storage,num_draft", [("paged", 7), ("dense", 3)])
def test_speculation_over_an_fp8_cache_equals_plain_decoding_over_it(tmp_path, storage, num_draft):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(4, 160, low=3, high=60)
    params = SamplingParams(max_tokens=int(torch.randint(20, 40, ())), temperature=0, ignore_eos=True)
    plain = LLM(target, None, kv_cache_dtype="fp8", **SETTINGS)
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, params)]
    plain.close()
    llm = LLM(target, drafter, kv_cache_dtype="fp8", context_storage=storage,
              num_speculative_tokens=num_draft, **SETTINGS)
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == expected
    assert llm.stats.num_drafts > 0 and llm.engine.pool_usage().num_used_blocks == 0
    llm.close()


def test_the_target_pages_take_one_byte_per_value_and_the_draft_context_keeps_its_dtype(tmp_path):
    target, drafter = make_pair(tmp_path)
    for dtype, itemsize in (("auto", 2), ("fp8", 1)):
        args = EngineArgs(target=str(target), drafter=str(drafter), dtype="bfloat16", kv_cache_dtype=dtype)
        plan = resolve_plan(args)
        config, spec = plan.target_config, plan.pool_spec()
        by_hand = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * itemsize
        assert spec.target.bytes_per_token == by_hand
        assert spec.draft.dtype == "bfloat16"
        assert spec.target.dtype == ("float8_e4m3fn" if dtype == "fp8" else "bfloat16")


def test_an_unknown_cache_dtype_is_refused_by_name(tmp_path):
    target, _ = make_pair(tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(target, None, kv_cache_dtype="int4", **SETTINGS)
