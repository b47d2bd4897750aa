"""The engine on a GPU: Triton kernels end to end, the pool budget from gpu_memory_utilization."""

import pytest
import torch
from engine_helpers import make_pair, random_prompts
from near_ties import TF32_TIE, assert_equal_up_to_a_near_tie

from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_greedy_with_drafter_equals_target_only_on_cuda(tmp_path, storage):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(6, 160, low=5, high=90)
    plain = LLM(target, device="cuda", dtype="float32", kv_cache_memory="64MiB", tokens_per_block=16)
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, GREEDY)]
    llm = LLM(target, drafter, device="cuda", dtype="float32", context_storage=storage, max_num_seqs=8,
              kv_cache_memory="64MiB", tokens_per_block=16, num_speculative_tokens=7, max_model_len=256)
    got = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    for prompt, ours, reference in zip(prompts, got, expected):  # equal, or parted at a near-tie
        assert_equal_up_to_a_near_tie(target, prompt, ours, reference, TF32_TIE)
    assert llm.stats.num_drafts > 0
    assert llm.engine.pool_usage().num_used_blocks == 0


@pytest.mark.parametrize("with_drafter", [True, False])
def test_cuda_graph_steps_equal_eager_steps_and_target_only_greedy(tmp_path, with_drafter):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(5, 160, low=5, high=90)  # 5 sequences: graphs of 8 with 3 dummies
    settings = dict(device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory="64MiB",
                    tokens_per_block=16, max_model_len=256, drafter=drafter if with_drafter else "none")
    outputs = {}
    for eager in (True, False):
        llm = LLM(target, enforce_eager=eager, **settings)
        outputs[eager] = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
        graphs = llm.assembly.runner.graphs
        assert (graphs is None) == eager
        if not eager:
            assert graphs.replays > 0  # the steady state ran from graphs
            if with_drafter:
                assert llm.assembly.runner.drafter.graphs.replays > 0
                assert llm.assembly.runner.drafter.context_graphs.replays > 0
        llm.close()
    plain = LLM(target, device="cuda", dtype="float32", kv_cache_memory="64MiB", tokens_per_block=16,
                enforce_eager=True)
    expected = [out.outputs[0].token_ids for out in plain.generate(prompts, GREEDY)]
    assert outputs[False] == outputs[True]  # at these lengths both plan the same attention splits
    for prompt, ours, reference in zip(prompts, outputs[False], expected):
        assert_equal_up_to_a_near_tie(target, prompt, ours, reference, TF32_TIE)


def test_a_context_graph_replay_stores_the_pages_an_eager_store_does(tmp_path):
    """Rows padded to a captured count: the replay writes the real rows' K/V as the eager store does
    (fp32; GEMMs over more rows may round differently in the last bits) and nothing for the rest."""
    target, drafter = make_pair(tmp_path)
    llm = LLM(target, drafter, device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory="64MiB",
              tokens_per_block=16, max_model_len=256)
    worker = llm.assembly.runner.drafter
    graphs, buffers = worker.context_graphs, worker.buffers
    num_rows = int(torch.randint(1, graphs.sizes[-1], ()))
    pages = [page for cache in worker.context.caches for page in cache[:2]]
    num_slots = pages[0].shape[0] * pages[0].shape[1]
    slots = torch.randperm(num_slots)[:num_rows]
    slots[torch.rand(num_rows) < 0.3] = -1  # rejected drafts
    buffers.stage_context(torch.randn(num_rows, buffers.layout.tap_width, device="cuda"),
                          torch.randint(0, 200, (num_rows,)).tolist(), [0] * num_rows, slots.tolist())
    before = [page.clone() for page in pages]
    worker.store_rows(num_rows)
    expected = [page.clone() for page in pages]
    for page, old in zip(pages, before):
        page.copy_(old)
    replays = graphs.replays
    assert graphs.run(num_rows) and graphs.replays == replays + 1
    torch.cuda.synchronize()
    for got, want in zip(pages, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    llm.close()


def test_pool_budget_from_gpu_memory_utilization(tmp_path):
    target, drafter = make_pair(tmp_path)
    _, total = torch.cuda.mem_get_info()
    llm = LLM(target, drafter, device="cuda", gpu_memory_utilization=0.02, max_num_seqs=4, max_model_len=256)
    pool_bytes = llm.assembly.pool.memory.nbytes
    # the pool takes what 2% of the device leaves after what is in use, never more
    assert 0 < pool_bytes <= 0.02 * total
    params = SamplingParams(max_tokens=4, ignore_eos=True)  # sampled from random weights: EOS may come
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_async_scheduling_with_graphs_equals_the_engine_without_it(tmp_path, storage):
    """On the GPU the step ahead is queued while the host reads the step before: same tokens,
    acceptance and finish reasons as reading every step first (stop tokens end requests mid-run)."""
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(6, 160, low=5, high=90)
    settings = dict(device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory="64MiB",
                    tokens_per_block=16, max_model_len=256, context_storage=storage, num_speculative_tokens=7)
    first = LLM(target, drafter, **settings)
    free = [out.outputs[0].token_ids for out in first.generate(prompts, GREEDY)]
    first.close()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop_token_ids=[free[0][12]])
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(target, drafter, async_scheduling=async_scheduling, **settings)
        outputs = llm.generate(prompts, params)
        results[async_scheduling] = ([out.outputs[0].token_ids for out in outputs],
                                     [out.outputs[0].finish_reason for out in outputs],
                                     llm.stats.num_accepted_tokens)
        assert (llm.engine.counters().num_steps_ahead > 0) == async_scheduling
        assert llm.assembly.runner.graphs.replays > 0
        assert llm.engine.pool_usage().num_used_blocks == 0
        llm.close()
    assert results[True] == results[False]
