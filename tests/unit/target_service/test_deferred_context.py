"""DeferredContext: rows held over several steps are staged exactly as the steps' rows, in order;
how many fit."""

from __future__ import annotations

import random

import pytest
import torch

from drafter_service.step_buffers import StepBufferLayout, StepBuffers
from target_service.proposers import deferred_context
from target_service.proposers.deferred_context import DeferredContext


class _Seq:
    def __init__(self, seq_id: int):
        self.seq_id = seq_id


def _buffers(max_context_rows: int = 512, tap_width: int = 24) -> StepBuffers:
    layout = StepBufferLayout(max_num_seqs=4, max_blocks_per_seq=4, max_num_draft=3,
                              max_context_rows=max_context_rows, tap_width=tap_width, tap_dtype="float32")
    return StepBuffers.create(layout, "cpu", share=False)


def _step(rng: random.Random, num_rows: int, tap_width: int):
    return (torch.randn(num_rows, tap_width), torch.randint(0, 1000, (num_rows,)),
            torch.randint(0, 4, (num_rows,)), torch.randint(-1, 5000, (num_rows,)))


def test_rows_held_over_steps_are_staged_in_order_and_the_steps_own_taps_may_be_overwritten():
    rng = random.Random()
    buffers = _buffers()
    deferred = DeferredContext(buffers)
    steps, step_taps = [], torch.empty(64, 24)  # one output buffer, rewritten by every step (as a graph's)
    for _ in range(rng.randint(2, 6)):
        taps, positions, seq_indices, slots = _step(rng, rng.randint(1, 40), 24)
        steps.append((taps.clone(), positions.clone(), seq_indices.clone(), slots.clone()))
        step_taps[: taps.shape[0]] = taps
        deferred.hold(step_taps[: taps.shape[0]], positions, seq_indices, slots, [_Seq(rng.randint(0, 3))])
        step_taps.normal_()
    num_rows, owners = deferred.stage(buffers)
    expected = [torch.cat(parts) for parts in zip(*steps)]
    assert num_rows == expected[0].shape[0] and deferred.count == 0 and owners
    assert torch.equal(buffers.taps[:num_rows], expected[0])
    assert torch.equal(buffers.context_positions[:num_rows], expected[1])
    assert torch.equal(buffers.context_seq_indices[:num_rows], expected[2])
    assert torch.equal(buffers.context_slots[:num_rows], expected[3])
    # after staging it holds nothing (staging again stages nothing), and takes rows again
    assert deferred.stage(buffers) == (0, [])
    deferred.hold(*_step(rng, 3, 24), [_Seq(9)])
    assert deferred.stage(buffers)[0] == 3


def test_room_is_bounded_by_rows_by_the_taps_bytes_and_by_the_step_buffers(monkeypatch):
    assert DeferredContext(_buffers(max_context_rows=2048)).capacity == deferred_context.MAX_DEFERRED_ROWS
    assert DeferredContext(_buffers(max_context_rows=100)).capacity == 100
    monkeypatch.setattr(deferred_context, "MAX_DEFERRED_BYTES", 10 * 24 * 4 + 95)  # 10 fp32 rows of 24
    assert DeferredContext(_buffers(max_context_rows=2048)).capacity == 10


def test_rows_that_do_not_fit_or_disagree_are_refused_and_nothing_is_held():
    rng = random.Random()
    deferred = DeferredContext(_buffers(max_context_rows=16))
    deferred.hold(*_step(rng, 10, 24), [_Seq(1)])
    with pytest.raises(ValueError, match="do not fit"):
        deferred.hold(*_step(rng, 7, 24), [_Seq(2)])
    taps, positions, seq_indices, slots = _step(rng, 4, 24)
    with pytest.raises(ValueError, match="positions must be"):
        deferred.hold(taps, positions[:3], seq_indices, slots, [_Seq(2)])
    assert deferred.count == 10 and set(deferred.owners) == {1}
