"""Async scheduling (a steady-state step queued before the one before it is read) changes no output.

Every case runs the same requests through an engine with and without it and compares tokens, finish
reasons and acceptance; the async engine must really have launched steps ahead (and, where a request
stops mid-run, dropped one). The pieces are checked alone too: the device-built decode batch against
`pack`, and the next inputs against the draft budget by hand (what `Scheduler.schedule_ahead` must
refuse is the scheduler's unit test).
"""

import pytest
import torch
from engine_helpers import OracleDrafter, make_pair, random_prompts

from target_service.engine.draft_budget import DraftBudget
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.scheduler import Scheduler
from target_service.llm import LLM
from target_service.runner.forward_batch import SeqChunk, pack
from target_service.runner.uniform_step import next_inputs, uniform_decode_batch

SETTINGS = dict(kv_cache_memory="4MiB", tokens_per_block=16, max_num_seqs=8, max_model_len=160)


def run(target, drafter, prompts, params, *, async_scheduling, **settings):
    llm = LLM(target, drafter, async_scheduling=async_scheduling, **{**SETTINGS, **settings})
    outputs = llm.generate(prompts, params)
    engine = llm.engine
    usage, counters = engine.pool_usage(), engine.counters()
    result = {
        "tokens": [out.outputs[0].token_ids for out in outputs],
        "finish": [out.outputs[0].finish_reason for out in outputs],
        "accepted": llm.stats.num_accepted_tokens, "drafts": llm.stats.num_draft_tokens,
        "ahead": counters.num_steps_ahead, "dropped": counters.num_dropped_ahead,
        "pages_in_use": usage.num_used_blocks,
    }
    llm.close()
    return result


def assert_same(sync, overlapped):
    for key in ("tokens", "finish", "accepted", "drafts"):
        assert overlapped[key] == sync[key], key
    assert sync["ahead"] == 0 and overlapped["ahead"] > 0
    assert sync["pages_in_use"] == overlapped["pages_in_use"] == 0


@pytest.mark.parametrize("storage,num_draft", [("paged", 7), ("dense", 7), ("paged", 1), ("none", None)])
def test_greedy_outputs_equal_with_and_without_async_scheduling(tmp_path, storage, num_draft):
    target, drafter = make_pair(tmp_path)
    drafter = None if storage == "none" else drafter
    settings = {} if drafter is None else dict(context_storage=storage, num_speculative_tokens=num_draft)
    prompts = random_prompts(5, 160, low=3, high=50)
    params = SamplingParams(max_tokens=int(torch.randint(30, 60, ())), temperature=0, ignore_eos=True)
    sync = run(target, drafter, prompts, params, async_scheduling=False, **settings)
    assert_same(sync, run(target, drafter, prompts, params, async_scheduling=True, **settings))


def test_a_full_batch_with_requests_waiting_still_runs_ahead(tmp_path, monkeypatch):
    """Six requests, two sequence indices: while both are taken the waiting ones cannot be admitted, so
    steps go ahead; a request waiting for an index freed by the current step starts a step later.
    Every request's tokens and acceptance equal the engine's without async scheduling."""
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(6, 160, low=3, high=40)
    params = [SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True)
              for n in torch.randint(10, 40, (len(prompts),))]
    sync = run(target, drafter, prompts, params, async_scheduling=False, max_num_seqs=2)
    ahead_while_waiting = []

    schedule_ahead = Scheduler.schedule_ahead

    def recording_schedule_ahead(scheduler, *args):
        planned = schedule_ahead(scheduler, *args)
        if planned is not None and scheduler.waiting:
            ahead_while_waiting.append(len(scheduler.waiting))
        return planned

    monkeypatch.setattr(Scheduler, "schedule_ahead", recording_schedule_ahead)
    assert_same(sync, run(target, drafter, prompts, params, async_scheduling=True, max_num_seqs=2))
    assert ahead_while_waiting


def test_a_request_stopping_mid_run_drops_its_step_ahead(tmp_path):
    """Stop tokens taken from the outputs themselves end requests mid-run, at different steps."""
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(4, 160, low=3, high=40)
    free = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    tokens = run(target, drafter, prompts, free, async_scheduling=False)["tokens"]
    stops = late_stop_tokens(tokens, earliest=8)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, stop_token_ids=stops)
    sync = run(target, drafter, prompts, params, async_scheduling=False)
    overlapped = run(target, drafter, prompts, params, async_scheduling=True)
    assert_same(sync, overlapped)
    assert "stop" in sync["finish"] and overlapped["dropped"] > 0


def late_stop_tokens(tokens: list[list[int]], *, earliest: int, count: int = 2) -> list[int]:
    """Tokens whose first appearance in every output is at `earliest` or later (or never), the soonest
    first: each ends a request in the steady state, where a step is already ahead, never at prefill."""
    first = {}
    for output in tokens:
        for position, token in enumerate(output):
            first[token] = min(first.get(token, position), position)
    late = sorted((position, token) for token, position in first.items() if position >= earliest)
    assert late, f"every output token appears before position {earliest}"
    return sorted(token for _, token in late[:count])


def test_high_acceptance_and_seeded_sampling_equal_without_async_scheduling(tmp_path):
    """Multi-token accepts (the next bonus is read after them on the device) with an oracle drafter,
    then seeded sampling (each request's own generator draws in the same order)."""
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(4, 160, low=3, high=40)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reference = run(target, None, prompts, greedy, async_scheduling=False)["tokens"]
    references = {tuple(p): p + out for p, out in zip(prompts, reference)}
    accepted = {}
    for async_scheduling in (False, True):
        llm = LLM(target, drafter, async_scheduling=async_scheduling, num_speculative_tokens=7, **SETTINGS)
        oracle = OracleDrafter(llm, references)
        assert [out.outputs[0].token_ids for out in llm.generate(prompts, greedy)] == reference
        accepted[async_scheduling] = llm.stats.num_accepted_tokens
        if not async_scheduling:  # (the oracle counts a step ahead's proposals before their limits are known)
            assert accepted[False] == oracle.expected_accepted
        assert llm.stats.mean_acceptance_length > 2.0
        assert (llm.engine.counters().num_steps_ahead > 0) == async_scheduling
        llm.close()
    assert accepted[True] == accepted[False]
    sampled = [SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=int(seed), ignore_eos=True)
               for seed in torch.randint(0, 2**31, (len(prompts),))]
    sync = run(target, drafter, prompts, sampled, async_scheduling=False)
    assert_same(sync, run(target, drafter, prompts, sampled, async_scheduling=True))


def test_abort_while_a_step_is_ahead_frees_everything_and_changes_no_other_output(tmp_path):
    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(3, 160, low=3, high=40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = run(target, drafter, prompts, params, async_scheduling=False)["tokens"]
    llm = LLM(target, drafter, **SETTINGS)
    engine = llm.engine
    seqs = [engine.add_request(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
    while engine.counters().num_steps_ahead == 0:  # then a step is ahead, launched and not yet read
        engine.step()
    engine.abort("r1")
    while engine.has_unfinished:
        engine.step()
    assert engine.counters().num_dropped_ahead >= 1 and seqs[1].finish_reason == "abort"
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == [expected[0], expected[2]]
    assert expected[1][:len(seqs[1].output_token_ids)] == seqs[1].output_token_ids
    assert engine.pool_usage().num_used_blocks == 0
    llm.close()


@pytest.mark.parametrize("draw", range(10))
def test_uniform_decode_batch_equals_pack(draw):
    tokens_per_block, num_draft = int(torch.randint(1, 5, ())) * 4, int(torch.randint(0, 6, ()))
    num_seqs = int(torch.randint(1, 6, ()))
    starts = torch.randint(0, 40, (num_seqs,))
    bonus = torch.randint(0, 100, (num_seqs,))
    columns = (int(starts.max()) + num_draft + 1 + tokens_per_block - 1) // tokens_per_block + 1
    table = torch.randint(0, 50, (num_seqs, columns), dtype=torch.int32)
    batch = uniform_decode_batch(bonus, starts, table, num_draft, tokens_per_block, taps=True)
    chunks = [SeqChunk([int(bonus[i])] + [0] * num_draft, int(starts[i]), table[i].tolist(), num_draft + 1,
                       num_draft + 1) for i in range(num_seqs)]
    expected = pack(chunks, tokens_per_block)
    for name in expected.__dataclass_fields__:
        assert torch.equal(getattr(batch, name), getattr(expected, name)), name


@pytest.mark.parametrize("draw", range(10))
def test_next_inputs_follow_the_accepted_drafts_and_the_schedulers_draft_rule(draw):
    """Bonus = the target's token after the accepted drafts; start + accepted + 1; the drafts that may
    count = the draft budget of that state (here by hand: min(K, mml - n - 2, left - 1))."""
    num_seqs, num_draft, max_model_len = int(torch.randint(1, 6, ())), 7, 64
    accepted = torch.randint(0, num_draft + 1, (num_seqs,))
    logit_starts = torch.arange(num_seqs) * (num_draft + 1)
    targets = torch.randint(0, 100, (num_seqs * (num_draft + 1),))
    starts = torch.randint(0, 60, (num_seqs,))
    remaining = torch.randint(1, 30, (num_seqs,))
    bonus, next_starts, limits = next_inputs(targets, accepted, logit_starts, starts, remaining,
                                             DraftBudget(num_draft, max_model_len))
    for i in range(num_seqs):
        a, n = int(accepted[i]), int(starts[i]) + int(accepted[i]) + 1
        left = int(remaining[i]) - (a + 1)
        assert int(bonus[i]) == int(targets[logit_starts[i] + a]) and int(next_starts[i]) == n
        assert int(limits[i]) == max(0, min(num_draft, max_model_len - n - 2, left - 1))


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_steps_ahead_through_the_graph_runners_equal_target_only(tmp_path, storage):
    """The graph runners (run eagerly on CPU, capture=False: the padding and the static inputs of a
    replay) fed the batches a step ahead builds on the device: tokens equal target-only greedy, and
    the drafts (so the acceptance) equal those of the engine without runners."""
    from drafter_service.context_graphs import ContextGraphs, context_row_sizes
    from drafter_service.cuda_graphs import ProposeGraphs
    from target_service.runner.cuda_graphs import GraphKey, TargetGraphs

    target, drafter = make_pair(tmp_path)
    prompts = random_prompts(3, 160, low=3, high=40)  # 3 sequences: graphs of 4 with one dummy
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = run(target, None, prompts, params, async_scheduling=False)["tokens"]
    settings = dict(num_speculative_tokens=7, context_storage=storage)
    eager = run(target, drafter, prompts, params, async_scheduling=True, **settings)
    llm = LLM(target, drafter, **settings, **SETTINGS)
    engine, runner, worker = llm.engine, llm.assembly.runner, llm.assembly.runner.drafter
    graphs = TargetGraphs(runner.target, runner.target_caches, sizes=[1, 2, 4, 8],
                          keys=[GraphKey(8, True), GraphKey(1, True)],
                          max_blocks_per_seq=SETTINGS["max_model_len"] // SETTINGS["tokens_per_block"],
                          device=torch.device("cpu"), capture=False)
    runner.graphs, worker.graphs = graphs, ProposeGraphs(worker, [1, 2, 4, 8], capture=False)
    rows = context_row_sizes([1, 2, 4, 8], worker.block_size, worker.buffers.layout.max_context_rows)
    worker.context_graphs = ContextGraphs(worker, rows, capture=False)
    served, stored = [], []
    graphs_run, context_run = graphs.run, worker.context_graphs.run
    graphs.run = lambda batch, key: served.append(batch.num_seqs) or graphs_run(batch, key)
    worker.context_graphs.run = lambda num_rows: stored.append(num_rows) or context_run(num_rows)
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == expected
    stats = llm.stats
    assert (stats.num_accepted_tokens, stats.num_draft_tokens) == (eager["accepted"], eager["drafts"])
    assert engine.counters().num_steps_ahead > 0
    # off a GPU only the kept context rows are stored (context_rows): counts between the captured sizes
    assert 3 in served and any(0 < count < max(rows) and count not in rows for count in stored), stored
    assert engine.pool_usage().num_used_blocks == 0
    llm.close()
