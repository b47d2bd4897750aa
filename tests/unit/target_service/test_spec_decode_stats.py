"""A request's speculative counters (`SpecDecodeStats`): the dense acceptance histogram, kept always,
and the per-step lists, kept only when `SamplingParams.spec_decode_per_step` asks, against values
worked out here from the (drafted, accepted) pairs. The engine runs over the bookkeeping test's fake
runner, which accepts what a random script says; the reference replays the draft budget by hand."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from test_engine_bookkeeping import FakeRunner, engine_over

from target_service.engine.outputs import SpecDecodeStats
from target_service.engine.sampling_params import SamplingParams


def random_steps(rng: random.Random, k: int, count: int) -> list[tuple[int, int]]:
    steps = []
    for _ in range(count):
        drafted = rng.randint(0, k)
        steps.append((drafted, rng.randint(0, drafted)))
    return steps


def recorded(steps, k: int, *, per_step: bool) -> SpecDecodeStats:
    stats = SpecDecodeStats.for_request(k, per_step=per_step)
    for drafted, accepted in steps:
        stats.record(drafted, accepted)
    return stats


@pytest.mark.parametrize("run", range(3))  # the seed is drawn in the test: every worker collects the same ids
def test_the_histogram_and_the_per_step_lists_are_the_steps_that_drafted(run):
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    k = rng.randint(1, 7)
    steps = random_steps(rng, k, rng.randint(0, 40))
    counted = [(d, a) for d, a in steps if d]  # a step that verified no draft is no draft
    stats = recorded(steps, k, per_step=True)
    by_accepted = Counter(a for _, a in counted)
    assert stats.acceptance_histogram == [by_accepted[j] for j in range(k + 1)]
    assert stats.num_spec_tokens == k and stats.num_drafts == len(counted)
    assert stats.per_step_accepted == [a for _, a in counted]
    assert stats.per_step_drafted == [d for d, _ in counted]
    assert stats.num_accepted_tokens == sum(j * n for j, n in enumerate(stats.acceptance_histogram))
    assert stats.num_draft_tokens == sum(d for d, _ in counted)


def test_without_per_step_only_the_o_k_counters_are_kept():
    rng = random.Random()
    steps = random_steps(rng, 4, 30)
    with_lists, without = recorded(steps, 4, per_step=True), recorded(steps, 4, per_step=False)
    assert without.per_step_accepted is None and without.per_step_drafted is None
    assert without.acceptance_histogram == with_lists.acceptance_histogram
    assert without.accepted_per_position == with_lists.accepted_per_position


def test_merge_adds_histograms_and_leaves_the_per_step_order_alone():
    rng = random.Random()
    first, second = random_steps(rng, 3, 20), random_steps(rng, 5, 20)
    total = SpecDecodeStats()  # engine-wide: starts empty and grows to the widest request's K
    for steps, k in ((first, 3), (second, 5)):
        total.merge(recorded(steps, k, per_step=True))
    assert total.acceptance_histogram == recorded(first + second, 5, per_step=False).acceptance_histogram
    assert total.per_step_accepted is None


def test_copy_is_independent_of_the_original():
    stats = recorded([(3, 1), (3, 3)], 3, per_step=True)
    copy = stats.copy()
    stats.record(3, 0)
    assert copy.acceptance_histogram == [0, 1, 0, 1] and copy.per_step_accepted == [1, 3]
    assert copy.per_step_drafted == [3, 3]


def expected_steps(script: list[int], k: int, max_tokens: int) -> list[tuple[int, int]]:
    """The (drafted, accepted) of each decode step, by hand: the prefill gives the first token; a step
    may count min(K, tokens left - 1) drafts (the draft budget, max_model_len far) and emits the
    accepted ones and one more."""
    steps, left, script = [], max_tokens - 1, iter(script)
    while left:
        may_count = min(k, left - 1)
        accepted = min(next(script), may_count)
        if may_count:
            steps.append((may_count, accepted))
        left -= accepted + 1
    return steps


@pytest.mark.parametrize("per_step", [True, False])
def test_the_engine_records_each_requests_verify_steps(per_step):
    rng = random.Random()
    k, max_tokens = 4, rng.randint(8, 30)
    script = [rng.randint(0, k) for _ in range(max_tokens)]
    steps = iter(script)
    engine, _ = engine_over(FakeRunner(accept=lambda seq: next(steps)), k=k, max_model_len=256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            spec_decode_per_step=per_step)
    seq = engine.add_request("r", [5, 6, 7], params)
    while engine.has_unfinished:
        engine.step()
    expected = recorded(expected_steps(script, k, max_tokens), k, per_step=per_step)
    assert seq.spec_decode == expected and len(seq.output_token_ids) == max_tokens
    assert len(seq.spec_decode.acceptance_histogram) == k + 1


def test_a_request_without_a_drafter_has_one_empty_bin():
    engine, _ = engine_over(FakeRunner(), k=0)
    seq = engine.add_request("r", [5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    assert seq.spec_decode.acceptance_histogram == [0] and seq.spec_decode.num_spec_tokens == 0
