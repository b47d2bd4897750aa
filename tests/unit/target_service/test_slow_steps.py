"""SlowSteps: a step with decodes that took over the threshold is counted and logged with what it held,
at most one line per interval (with the count since); and the engine feeds it the time from one read
to the next, so a slow read with streams running shows in its counters."""

from __future__ import annotations

import logging
import random
import time

import pytest
from test_engine_bookkeeping import FakeRunner, engine_over

from foundation.gc_pauses import GcPauses
from target_service.engine.sampling_params import SamplingParams
from target_service.engine.scheduler_output import DecodeWork, PrefillChunk, SchedulerOutput
from target_service.engine.sequence import Sequence
from target_service.engine.slow_steps import SlowSteps, describe_step


def seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(f"r{seq_id}", seq_id, list(range(prompt_len)), SamplingParams(max_tokens=4), seq_id)


def plan_of(num_decodes: int, chunks: list[tuple[int, int]], drafts: int) -> SchedulerOutput:
    decodes = [DecodeWork(seq(i, 8), drafts, drafts) for i in range(num_decodes)]
    prefills = [PrefillChunk(seq(100 + i, start + tokens), start, tokens)
                for i, (start, tokens) in enumerate(chunks)]
    return SchedulerOutput(decodes, prefills)


def test_a_step_is_described_by_its_decodes_drafts_and_chunks():
    n, tokens = random.randint(2, 40), random.randint(1000, 4000)
    plan = plan_of(n, [(0, tokens), (512, 37)], drafts=15)
    assert describe_step(plan, [15] * n) == (f"{n} decodes (15 drafts each), 2 prefill chunks "
                                             f"({tokens:,} + 37 tokens, 1 starting past position 0)")
    assert describe_step(plan_of(3, [], 0), [0, 3, 7]) == "3 decodes (0-7 drafts)"


def test_slow_steps_are_counted_each_and_logged_once_per_interval(caplog):
    now = [0.0]
    slow = SlowSteps(threshold_s=0.25, log_every_s=10.0, clock=lambda: now[0], gc_pauses=GcPauses())
    plan = plan_of(4, [(0, 2048)], drafts=7)
    durations = [random.uniform(0.26, 2.0) for _ in range(5)]
    with caplog.at_level(logging.WARNING, logger="target_service.engine.slow_steps"):
        slow.observe(0.25, plan, [7] * 4)  # at the threshold: not slow
        for seconds in durations[:3]:
            slow.observe(seconds, plan, [7] * 4)
            now[0] += 1.0
        now[0] = 12.0
        for seconds in durations[3:]:
            slow.observe(seconds, plan, [7] * 4)
    assert slow.count == 5
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2  # the first, then the first after 10 s, which says how many it stood for
    assert lines[0] == (f"a step kept the running streams waiting {1e3 * durations[0]:.0f} ms: 4 decodes "
                        "(7 drafts each), 1 prefill chunks (2,048 tokens)")
    assert lines[1].startswith(f"a step kept the running streams waiting {1e3 * durations[3]:.0f} ms")
    assert lines[1].endswith("(2 more since the last report)")


class SlowReads(FakeRunner):
    """Reads the `slow_at`-th step (counting from 1) `delay` seconds late."""

    def __init__(self, slow_at: int, delay: float):
        super().__init__(accept=lambda seq: 1)
        self.slow_at, self.delay, self.reads = slow_at, delay, 0

    def read(self, launched):
        self.reads += 1
        if self.reads == self.slow_at:
            time.sleep(self.delay)
        return super().read(launched)


def test_the_engine_counts_a_slow_step_only_when_streams_were_waiting():
    engine, _ = engine_over(SlowReads(slow_at=1, delay=0.3))  # the first step: a prefill, nobody waits
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    assert engine.counters().num_slow_steps == 0
    slow_at = random.randint(3, 4)
    engine, _ = engine_over(SlowReads(slow_at=slow_at, delay=0.3))
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    assert engine.counters().num_slow_steps == 1


def test_the_environment_sets_the_threshold_and_interval(monkeypatch):
    threshold_ms, interval_s = random.randint(20, 200), random.choice([0, 2.5])
    monkeypatch.setenv("DFLASH_SLOW_STEP_MS", str(threshold_ms))
    monkeypatch.setenv("DFLASH_SLOW_STEP_LOG_EVERY_S", str(interval_s))
    slow = SlowSteps.from_env()
    assert (slow.threshold_s, slow.log_every_s) == (threshold_ms / 1e3, interval_s)
    plan = plan_of(2, [], drafts=3)
    slow.observe(threshold_ms / 1e3 * 0.99, plan, [3, 3])
    slow.observe(threshold_ms / 1e3 * 1.01, plan, [3, 3])
    assert slow.count == 1
    monkeypatch.delenv("DFLASH_SLOW_STEP_MS")
    monkeypatch.delenv("DFLASH_SLOW_STEP_LOG_EVERY_S")
    assert (SlowSteps.from_env().threshold_s, SlowSteps.from_env().log_every_s) == (0.25, 10.0)


def test_a_bad_environment_value_is_named(monkeypatch):
    for bad in ("fast", "-5", "nan", "inf"):
        monkeypatch.setenv("DFLASH_SLOW_STEP_MS", bad)
        try:
            SlowSteps.from_env()
        except ValueError as error:
            assert str(error) == f"DFLASH_SLOW_STEP_MS must be a number >= 0, got {bad!r}"
        else:
            raise AssertionError(f"{bad!r} was taken")


def test_a_slow_steps_line_says_how_much_of_it_the_garbage_collector_took(caplog):
    now = [100.0]
    pauses = GcPauses(clock=lambda: now[0])
    lengths = [random.uniform(0.001, 0.05) for _ in range(3)]
    pauses.on_gc("start", {"generation": 0})  # long before the step: not its
    now[0] += 0.01
    pauses.on_gc("stop", {"generation": 0})
    now[0] += 5.0
    for generation, length in zip((0, 2, 1), lengths):
        pauses.on_gc("start", {"generation": generation})
        now[0] += length
        pauses.on_gc("stop", {"generation": generation})
    step_s = sum(lengths) + 0.02
    assert pauses.within(step_s) == (pytest.approx(sum(lengths)), 2)
    slow = SlowSteps(threshold_s=0.01, log_every_s=0.0, gc_pauses=pauses)
    with caplog.at_level(logging.WARNING, logger="target_service.engine.slow_steps"):
        slow.observe(step_s, plan_of(8, [], drafts=0), [0] * 8)
    assert caplog.records[-1].getMessage() == (
        f"a step kept the running streams waiting {1e3 * step_s:.0f} ms (garbage collection "
        f"{1e3 * sum(lengths):.0f} ms of it, up to generation 2): 8 decodes (0 drafts each)")


def test_a_steps_time_is_a_verifys_only_back_to_back_decode_only_and_of_one_k():
    from target_service.engine.step_record import StepRecord

    now = [0.0]
    record = StepRecord(clock=lambda: now[0])
    k, gaps = random.randint(1, 15), [random.uniform(0.001, 0.05) for _ in range(5)]
    steps = [(plan_of(3, [], k), [k] * 3),  # the first read: nothing before it
             (plan_of(3, [], k), [k] * 3),  # back to back, decode-only, one k: its time
             (plan_of(2, [(0, 64)], k), [k] * 2),  # a prefill chunk beside: not a verify's time
             (plan_of(3, [], k), [k, k, 0]),  # two k's
             (plan_of(3, [], k), [k] * 3)]
    times = []
    for gap, (plan, verified) in zip(gaps, steps):
        now[0] += gap
        times.append(record.read(plan, verified))
    assert times == [None, pytest.approx(gaps[1]), None, None, pytest.approx(gaps[4])]
    record.went_idle()
    now[0] += 5.0
    assert record.read(*steps[1]) is None  # after an idle gap
    assert record.num_steps == 6 and record.decode_steps_by_drafts == {k: 4}
