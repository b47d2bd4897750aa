"""LLMEngine alone, over a fake runner and a fake pool: the books of a step (what is emitted, what is
committed, what the counters say, when a request ends) and the pool-lost path, against values worked
out here. No model runs: the fake runner's target picks token (position * 7 + seq_id) % 97 at every
row and accepts the number of drafts a script says."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from fake_pool import FakePool

from kvpool_service.errors import InvalidRequest, StaleEpoch, TransportError
from target_service.engine.draft_budget import DraftBudget
from target_service.engine.engine import LLMEngine
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.scheduler import Scheduler
from target_service.engine.scheduler_output import SchedulerOutput
from target_service.engine.step_runner import StepTokens
from target_service.engine.stop_checker import StopChecker

VOCAB = 97


def target_token(seq, position: int) -> int:
    return (position * 7 + seq.seq_id) % VOCAB


@dataclass
class Launched:
    plan: SchedulerOutput
    verified: list[int]
    max_accepted: list[int] | None
    failed: dict = field(default_factory=dict)
    proposers: list = field(default_factory=list)  # who drafted: the fake names nobody


class FakeRunner:
    """A `StepRunner`: launches nothing, reads the target's tokens off `target_token`; each decode
    accepts `accept(seq)` drafts (capped at what may count); `errors` are raised by launches, in turn."""

    vocab_size = VOCAB
    num_steps_ahead = 0

    def __init__(self, accept=lambda seq: 0, errors=()):
        self.accept, self.errors, self.launched = accept, list(errors), []
        self.timed: list[SchedulerOutput] = []  # the plans whose step the engine timed (step_took)

    def make_generator(self, seed):
        return random.Random(seed)

    def launch(self, plan):
        if self.errors:
            raise self.errors.pop(0)
        self.launched.append(plan)
        verified = [work.num_verified for work in plan.decodes]
        return Launched(plan, verified, [min(w.max_accepted, v) for w, v in zip(plan.decodes, verified)])

    def launch_after(self, current, plan):
        return None

    def read(self, launched):
        plan = launched.plan
        decode_tokens = [[target_token(w.seq, w.seq.num_computed + row) for row in range(w.num_verified + 1)]
                         for w in plan.decodes]
        accepted = [min(self.accept(w.seq), cap) for w, cap in zip(plan.decodes, launched.max_accepted)]
        prefill = [[target_token(c.seq, c.start + c.num_tokens - 1)] if c.is_last else []
                   for c in plan.prefills]
        return StepTokens(decode_tokens, accepted, prefill)

    def step_took(self, launched, seconds):
        assert seconds >= 0
        self.timed.append(launched.plan)


def engine_over(runner, pool=None, *, k=3, max_model_len=64, on_pool_lost=None, eos=()):
    pool = pool or FakePool(256)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64,
                          draft_budget=DraftBudget(k, max_model_len))
    engine = LLMEngine(runner, scheduler, limits=pool.limits(), stop_checker=StopChecker(eos),
                       async_scheduling=False, on_pool_lost=on_pool_lost)
    return engine, pool


def test_each_step_emits_the_target_tokens_up_to_the_first_rejected_draft():
    accepted = {0: 2, 1: 0}
    engine, pool = engine_over(FakeRunner(accept=lambda seq: accepted[seq.seq_id]), k=3)
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", [5, 6, 7, 8, 9], params) for i in range(2)]
    engine.step()  # prefill: the first token is the target's at the last prompt position
    assert [seq.output_token_ids for seq in seqs] == [[target_token(seq, 4)] for seq in seqs]
    while engine.has_unfinished:
        engine.step()
    for seq in seqs:
        # by hand: positions 4, 5, ... each give the target's token; a step emits accepted + 1 of them
        assert seq.output_token_ids == [target_token(seq, p) for p in range(4, 4 + 9)]
        assert seq.finish_reason == "length" and seq.num_computed == 5 + 9 - 1
    # r0 accepts 2 per step: 1 (prefill) + 3 + 3 + 2 (capped by max_tokens) tokens; r1 one per step
    assert seqs[0].spec_decode.num_drafts == 3 and seqs[0].spec_decode.num_accepted_tokens == 2 + 2 + 1
    # r1 one per step: 8 steps, of which the last may count no draft (1 token left)
    assert seqs[1].spec_decode.num_drafts == 7 and seqs[1].spec_decode.num_accepted_tokens == 0
    assert engine.stats.num_drafts == 10 and engine.counters().num_steps == 1 + 8
    assert pool.blocks == {} and ("close", [0]) in pool.calls  # finished: their pages went back
    assert engine.num_requests == 2 and engine.release("r0") is seqs[0] and not engine.has_request("r0")


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    runner = FakeRunner(accept=lambda seq: 3)
    engine, _ = engine_over(runner, k=3)
    stop = (5 * 7 + 0) % VOCAB  # the target's token at position 5 for seq 0: the fourth emitted
    params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop])
    seq = engine.add_request("r", [1, 2, 3], params)
    while engine.has_unfinished:
        engine.step()
    assert seq.output_token_ids == [target_token(seq, p) for p in (2, 3, 4, 5)]
    assert seq.finish_reason == "stop"


def test_release_and_abort_say_what_is_wrong():
    engine, pool = engine_over(FakeRunner())
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r", [1, 2], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="has not finished; abort it"):
        engine.release("r")
    engine.step()
    assert engine.abort("r").finish_reason == "abort" and pool.blocks == {}
    with pytest.raises(ValueError, match="not in the engine"):
        engine.abort("r")


def test_a_step_that_finds_the_pool_gone_hands_it_to_on_pool_lost_and_finishes_nothing():
    lost = []
    runner = FakeRunner(errors=[TransportError("UNAVAILABLE: connection refused", code="UNAVAILABLE"),
                                StaleEpoch("epoch 5 is not this pool's epoch"), InvalidRequest("a bug")])
    engine, _ = engine_over(runner, on_pool_lost=lost.append)
    seq = engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    assert engine.step() == [] and engine.step() == []
    assert [type(error) for error in lost] == [TransportError, StaleEpoch]
    with pytest.raises(InvalidRequest):  # anything else is not the pool going away
        engine.step()
    while engine.has_unfinished:
        engine.step()
    assert seq.finish_reason == "length" and engine.counters().num_pool_recoveries == 2


def test_without_on_pool_lost_a_pool_error_propagates():
    engine, _ = engine_over(FakeRunner(errors=[TransportError("gone", code="UNAVAILABLE")]))
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(TransportError):
        engine.step()


def test_rebind_pool_requeues_the_running_and_refuses_other_limits():
    engine, pool = engine_over(FakeRunner())
    seqs = [engine.add_request(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10)) for i in range(2)]
    engine.step()
    new_pool, old_calls = FakePool(256), len(pool.calls)
    with pytest.raises(ValueError, match="limits"):
        engine.rebind_pool(new_pool, FakePool(8).limits())
    assert engine.rebind_pool(new_pool, new_pool.limits()) == seqs
    assert engine.num_running == 0 and engine.num_waiting == 2 and engine.counters().num_preemptions == 2
    while engine.has_unfinished:
        engine.step()
    for seq in seqs:  # recomputed into the new pool: the same tokens
        assert seq.output_token_ids == [target_token(seq, p) for p in range(4, 14)]
    assert new_pool.blocks == {} and len(pool.calls) == old_calls  # the old pool is never asked again


def test_only_decode_steps_that_followed_a_step_without_a_gap_are_timed_for_the_runner():
    """A step's time (for the hybrid's choice) is the time from the read before it to its own: a step
    that prefilled costs more than a decode, and the first step after the engine went idle began at
    no read. The steps the fake runner is asked to time are exactly the others."""
    runner = FakeRunner(accept=lambda seq: random.randint(0, 3))
    engine, _ = engine_over(runner, k=3)
    expected = []
    for request in range(2):  # the engine goes idle between the two
        engine.add_request(f"r{request}", [1, 2, 3, 4][: random.randint(2, 4)],
                           SamplingParams(max_tokens=random.randint(3, 12), temperature=0, ignore_eos=True))
        after_read = False
        while engine.has_unfinished:
            engine.step()
            plan = runner.launched[-1]
            if after_read and plan.decodes and not plan.prefills:
                expected.append(plan)
            after_read = True
    assert [id(plan) for plan in runner.timed] == [id(plan) for plan in expected] and expected
