"""Scheduler alone, over a fake `PoolControl` that counts blocks by hand: admission, the chunk budget,
preemption order, the draft budget, and what `schedule_ahead` must refuse.

The engine's end-to-end tests show the scheduler's plans produce target-only tokens; these show the
plans themselves against numbers worked out here, with no model, no tensors and no pool memory.
"""

from __future__ import annotations

import random

import pytest
from fake_pool import TOKENS_PER_BLOCK, FakePool

from kvpool_service.block_manager import BlockManager
from target_service.engine.draft_budget import DraftBudget
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.scheduler import Scheduler
from target_service.engine.scheduler_output import DecodeWork, SchedulerOutput
from target_service.engine.sequence import Sequence, SequenceStatus

GREEDY = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
PREFIX_GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def scheduler_over(pool, *, k=3, max_model_len=64, max_num_seqs=8, budget=32) -> Scheduler:
    return Scheduler(pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     draft_budget=DraftBudget(k, max_model_len))


def add(scheduler: Scheduler, count: int, length: int, params=GREEDY) -> list[Sequence]:
    start = len(scheduler.waiting) + len(scheduler.running)
    seqs = [Sequence(f"r{start + i}", start + i, list(range(1, length + 1)), params, start + i)
            for i in range(count)]
    for seq in seqs:
        scheduler.add(seq)
    return seqs


def finish_step(scheduler: Scheduler, plan: SchedulerOutput, accepted: int = 0) -> None:
    """What the engine does after a step: prefill chunks computed (the last one emits a token), each
    decode's bonus and `accepted` drafts computed and emitted."""
    for chunk in plan.prefills:
        chunk.seq.num_computed = chunk.start + chunk.num_tokens
        if chunk.is_last:
            chunk.seq.output_token_ids.append(7)
    for work in plan.decodes:
        taken = min(accepted, work.max_accepted)
        work.seq.num_computed += taken + 1
        work.seq.output_token_ids += [7] * (taken + 1)
    scheduler.commit(plan.seqs)


def test_admission_takes_waiting_requests_in_order_within_max_num_seqs_and_the_token_budget():
    pool = FakePool(64)
    scheduler = scheduler_over(pool, max_num_seqs=2, budget=10)
    first, second, third = add(scheduler, 3, 6)
    plan = scheduler.schedule()
    # the budget of 10 tokens: all 6 of the first prompt, 4 of the second (chunked); max_num_seqs: 2
    assert [(c.seq, c.start, c.num_tokens) for c in plan.prefills] == [(first, 0, 6), (second, 0, 4)]
    assert list(scheduler.waiting) == [third] and scheduler.running == [first, second]
    assert first.status is second.status is SequenceStatus.RUNNING and third.status is SequenceStatus.WAITING
    assert len(first.block_table) == len(second.block_table) == 2  # 6 prompt tokens, 4 per block
    finish_step(scheduler, plan)
    plan = scheduler.schedule()
    # the first decodes (K + 1 rows), the second prefills on from position 4; no index left for the third
    assert [(w.seq, w.num_verified) for w in plan.decodes] == [(first, 3)]
    assert [(c.seq, c.start, c.num_tokens) for c in plan.prefills] == [(second, 4, 2)]
    assert list(scheduler.waiting) == [third]


def test_a_prompt_longer_than_the_budget_prefills_in_chunks_of_the_budget():
    scheduler = scheduler_over(FakePool(64), budget=16)
    (seq,) = add(scheduler, 1, 40)
    chunks = []
    while seq.is_prefilling or not seq.output_token_ids:
        plan = scheduler.schedule()
        chunks += [(c.start, c.num_tokens) for c in plan.prefills]
        finish_step(scheduler, plan)
    assert chunks == [(0, 16), (16, 16), (32, 8)]


def test_when_pages_run_out_the_newest_running_sequence_is_preempted_and_waits_first():
    pool = FakePool(5)  # 20 token slots
    scheduler = scheduler_over(pool, k=3)
    seqs = add(scheduler, 3, 4)  # one block each
    finish_step(scheduler, scheduler.schedule())  # prefilled: each needs positions 4..7 next (2 blocks)
    plan = scheduler.schedule()
    newest = seqs[2]
    assert plan.preempted == [newest] and [w.seq for w in plan.decodes] == seqs[:2]
    assert scheduler.waiting[0] is newest and newest.status is SequenceStatus.WAITING
    assert newest.block_table == [] and newest.num_computed == 0 and newest.num_preemptions == 1
    assert ("close", [newest.seq_id]) in pool.calls and scheduler.num_preemptions == 1
    assert not plan.prefills  # nothing is admitted in a step that preempted
    # recompute: it prefills everything but its newest token, which becomes the bonus again
    assert newest.prefill_len == len(newest.token_ids) - 1


@pytest.mark.parametrize("draw", range(20))
def test_decodes_verify_k_and_may_count_what_the_draft_budget_allows(draw):
    rng = random.Random(draw)
    k, max_model_len = rng.randint(1, 8), rng.randint(20, 48)
    scheduler = scheduler_over(FakePool(512), k=k, max_model_len=max_model_len, budget=512)
    max_tokens = rng.randint(2, 30)
    (seq,) = add(scheduler, 1, rng.randint(2, 10), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finish_step(scheduler, scheduler.schedule())
    while not seq.is_finished and len(seq.output_token_ids) < max_tokens and \
            seq.num_tokens < max_model_len:
        plan = scheduler.schedule()
        (work,) = plan.decodes
        n, left = seq.num_computed, max_tokens - len(seq.output_token_ids)
        assert work.max_accepted == max(0, min(k, max_model_len - n - 2, left - 1))  # by hand
        assert work.num_verified == (k if n + k + 2 <= max_model_len else work.max_accepted)
        finish_step(scheduler, plan, accepted=rng.randint(0, k))
    assert len(seq.output_token_ids) <= max_tokens and seq.num_tokens <= max_model_len


def test_a_sequence_without_draft_context_verifies_nothing():
    scheduler = scheduler_over(FakePool(64), k=3)
    (seq,) = add(scheduler, 1, 5)
    finish_step(scheduler, scheduler.schedule())
    seq.has_context = False
    (work,) = scheduler.schedule().decodes
    assert (work.num_verified, work.max_accepted) == (0, 0)


def test_schedule_ahead_plans_only_the_step_schedule_would_plan_next():
    pool = FakePool(64, max_num_seqs=8)
    scheduler = scheduler_over(pool, k=3, max_model_len=64, max_num_seqs=8)
    (seq,) = add(scheduler, 1, 4)
    finish_step(scheduler, scheduler.schedule())  # prefilled: decoding
    current = SchedulerOutput(decodes=[DecodeWork(seq, 3, 3)])
    with_a_prefill = SchedulerOutput(decodes=current.decodes, prefills=[object()])
    assert scheduler.schedule_ahead(with_a_prefill, [3]) is None
    assert scheduler.schedule_ahead(SchedulerOutput(), []) is None
    seq.params = SamplingParams(max_tokens=100, temperature=0.8)  # sampled with the shared generator
    assert scheduler.schedule_ahead(current, [3]) is None
    seq.params = GREEDY
    seq.has_context = False  # would verify no drafts after `current`
    assert scheduler.schedule_ahead(current, [3]) is None
    seq.has_context = True
    # after `current` accepts all 3 its 3 + 1 rows (and one more token) must fit max_model_len
    scheduler.draft_budget = DraftBudget(3, seq.num_computed + 4 + 3 + 1)
    assert scheduler.schedule_ahead(current, [3]) is None
    scheduler.draft_budget = DraftBudget(3, 64)
    (waiting,) = add(scheduler, 1, 2)
    assert scheduler.schedule_ahead(current, [3]) is None  # an admission would change the plan
    scheduler.max_num_seqs = 1  # ... unless every sequence index is taken
    assert scheduler.schedule_ahead(current, [3]) is not None
    scheduler.max_num_seqs = 8
    scheduler.abort(waiting)
    before, reserves = list(seq.block_table), len(pool.calls)
    planned = scheduler.schedule_ahead(current, [3])
    assert [(w.seq, w.num_verified, w.max_accepted) for w in planned.decodes] == [(seq, 3, 3)]
    # pages for the longest outcome: every draft of `current` accepted, then K + 1 more rows
    assert pool.calls[reserves:] == [("reserve", [(seq.seq_id, seq.num_computed + 4 + 4)])]
    assert seq.block_table[:len(before)] == before
    assert len(seq.block_table) * TOKENS_PER_BLOCK >= seq.num_computed + 8


def test_schedule_ahead_leaves_preemption_to_schedule():
    pool = FakePool(2)
    scheduler = scheduler_over(pool, k=3)
    (seq,) = add(scheduler, 1, 3)
    finish_step(scheduler, scheduler.schedule())
    current = SchedulerOutput(decodes=[DecodeWork(seq, 3, 3)])
    assert scheduler.schedule_ahead(current, [3]) is None  # 3 + 4 + 4 positions: 3 blocks of 4, 2 exist
    assert scheduler.running == [seq] and scheduler.num_preemptions == 0


def test_rebind_requeues_every_running_sequence_for_recompute_oldest_first():
    scheduler = scheduler_over(FakePool(64), k=3)
    seqs = add(scheduler, 3, 4)
    finish_step(scheduler, scheduler.schedule())
    seqs[1].finish_reason = "stop"  # it finished in the step the old pool failed in
    new_pool = FakePool(64)
    requeued = scheduler.rebind(new_pool)
    assert requeued == [seqs[0], seqs[2]] and list(scheduler.waiting) == [seqs[0], seqs[2]]
    assert seqs[1].status is SequenceStatus.FINISHED and not scheduler.running
    assert scheduler.pool is new_pool and not new_pool.calls  # the new pool never knew them
    assert all(seq.num_computed == 0 and not seq.block_table for seq in requeued)


def test_a_prefix_hit_keeps_its_cached_context_when_its_first_step_loses_the_drafter():
    """The pool opens a prefix hit with num_context = its cached tokens; a first step the drafter missed
    (has_context False) must commit no less, or the pool refuses the shrink and the engine dies."""
    pool = BlockManager(16, 4, max_num_seqs=4, max_model_len=64, watermark=0.0)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=32, draft_budget=DraftBudget(3, 64))
    prompt = list(range(1, 11))  # 10 tokens: two full blocks of 4 to cache
    first = Sequence("a", 0, prompt, PREFIX_GREEDY, 0)
    scheduler.add(first)
    scheduler.schedule()
    first.num_computed = len(prompt)
    scheduler.commit([first])
    scheduler.finish([first])
    again = Sequence("b", 1, prompt, PREFIX_GREEDY, 1)
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached_tokens == 8
    again.has_context = False  # what the runner writes when the drafter missed this step
    again.num_computed = len(prompt)
    scheduler.commit([again])  # before the fix: InvalidRequest 'lengths cannot shrink ... num_context 8 -> 0'
    assert again.num_context == 8 == pool.get(1).num_context


@pytest.mark.parametrize("cap", [None, 1, 5, 13])
def test_beside_decodes_a_step_prefills_at_most_the_cap_and_alone_the_whole_budget(cap):
    """The running streams wait for every step: beside them a prompt gets `cap` tokens a step; with
    no stream running it gets the step's whole budget (minus nothing)."""
    budget, k = 40, 3
    scheduler = Scheduler(FakePool(256), max_num_seqs=8, max_num_batched_tokens=budget,
                          draft_budget=DraftBudget(k, 512), max_prefill_tokens_with_decodes=cap)
    first = add(scheduler, 1, 6)[0]
    plan = scheduler.schedule()
    assert [(c.seq, c.num_tokens) for c in plan.prefills] == [(first, 6)]
    finish_step(scheduler, plan)
    length = random.randint(60, 200)
    long_prompt = add(scheduler, 1, length)[0]
    prefilled = 0
    while long_prompt.is_prefilling or long_prompt.status != SequenceStatus.RUNNING:
        plan = scheduler.schedule()
        assert [work.seq for work in plan.decodes] == [first]
        rows = sum(work.num_verified + 1 for work in plan.decodes)
        chunk = sum(c.num_tokens for c in plan.prefills if c.seq is long_prompt)
        assert chunk == min(length - prefilled, budget - rows, cap or budget)  # by hand
        prefilled += chunk
        finish_step(scheduler, plan)
    assert prefilled == length
