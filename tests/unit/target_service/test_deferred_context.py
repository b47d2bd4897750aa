"""DeferredContext: rows held over several steps are staged exactly as the steps' rows, in order (picked
ones, and a GPU's unpicked ones picked together); how many fit."""

from __future__ import annotations

import random

import pytest
import torch

from drafter_service.step_buffers import StepBufferLayout, StepBuffers
from target_service.proposers import deferred_context
from target_service.proposers.deferred_context import DeferredContext
from target_service.runner.context_rows import (
    ContextRows,
    KeptRows,
    RowSelection,
    SeqTaps,
    select_context_rows,
)
from target_service.runner.forward_batch import SeqChunk, pack


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


def _rows(taps, positions, seq_indices, slots) -> ContextRows:
    return ContextRows(taps, KeptRows(positions, seq_indices, slots))


def test_rows_held_over_steps_are_staged_in_order_and_the_steps_own_taps_may_be_overwritten():
    rng = random.Random()
    buffers = _buffers()
    deferred = DeferredContext(buffers)
    steps, step_taps = [], torch.empty(64, 24)  # one output buffer, rewritten by every step (as a graph's)
    for _ in range(rng.randint(2, 6)):
        taps, positions, seq_indices, slots = _step(rng, rng.randint(1, 40), 24)
        steps.append((taps.clone(), positions.clone(), seq_indices.clone(), slots.clone()))
        step_taps[: taps.shape[0]] = taps
        held = _rows(step_taps[: taps.shape[0]], positions, seq_indices, slots)
        deferred.hold(held, [_Seq(rng.randint(0, 3))])
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
    deferred.hold(_rows(*_step(rng, 3, 24)), [_Seq(9)])
    assert deferred.stage(buffers)[0] == 3


def test_room_is_bounded_by_rows_by_the_taps_bytes_and_by_the_step_buffers(monkeypatch):
    assert DeferredContext(_buffers(max_context_rows=2048)).capacity == deferred_context.MAX_DEFERRED_ROWS
    assert DeferredContext(_buffers(max_context_rows=100)).capacity == 100
    monkeypatch.setattr(deferred_context, "MAX_DEFERRED_BYTES", 10 * 24 * 4 + 95)  # 10 fp32 rows of 24
    assert DeferredContext(_buffers(max_context_rows=2048)).capacity == 10


def test_rows_that_do_not_fit_or_disagree_are_refused_and_nothing_is_held():
    rng = random.Random()
    deferred = DeferredContext(_buffers(max_context_rows=16))
    deferred.hold(_rows(*_step(rng, 10, 24)), [_Seq(1)])
    with pytest.raises(ValueError, match="do not fit"):
        deferred.hold(_rows(*_step(rng, 7, 24)), [_Seq(2)])
    taps, positions, seq_indices, slots = _step(rng, 4, 24)
    with pytest.raises(ValueError, match="the rows' indices cover 3 rows"):
        deferred.hold(_rows(taps, positions[:3], seq_indices[:3], slots[:3]), [_Seq(2)])
    assert deferred.count == 10 and set(deferred.owners) == {1}


def _decode_step(rng: random.Random, num_seqs: int, num_draft: int):
    """A lookup-only step as a GPU engine hands it over: every verify row unpicked, with random accepted
    drafts, context gaps and block tables; and the rows picked at once, the reference."""
    chunks, seqs = [], []
    for index in range(num_seqs):
        start = rng.randint(0, 40)
        table = rng.sample(range(200), (start + num_draft + 1) // 16 + 1)
        chunks.append(SeqChunk([1] * (num_draft + 1), start, table, num_draft + 1, num_draft + 1))
        seqs.append(SeqTaps(num_draft + 1, True, rng.random() < 0.8, index))
    batch = pack(chunks, 16)
    accepted = torch.tensor([rng.randint(0, num_draft) for _ in seqs], dtype=torch.int64)
    selection = RowSelection.of(batch, seqs, accepted)
    return selection, select_context_rows(batch, seqs, accepted)


def test_unpicked_rows_held_over_steps_are_picked_together_as_each_step_alone():
    """A GPU engine's held steps (`RowSelection`s) are picked once, at staging: the staged rows equal
    every step's rows picked as it ran, in order, with the taps each step had."""
    rng = random.Random()
    buffers = _buffers()
    deferred = DeferredContext(buffers)
    step_taps, expected_taps, expected_rows = torch.empty(64, 24), [], []
    for _ in range(rng.randint(2, 5)):
        selection, picked = _decode_step(rng, rng.randint(1, 4), rng.randint(1, 7))
        taps = torch.randn(selection.num_rows, 24)
        step_taps[:taps.shape[0]] = taps
        deferred.hold(ContextRows(step_taps[:taps.shape[0]], selection), [_Seq(0)])
        step_taps.normal_()
        expected_taps.append(taps)
        expected_rows.append(picked)
    num_rows, _ = deferred.stage(buffers)
    assert num_rows == sum(taps.shape[0] for taps in expected_taps)
    assert torch.equal(buffers.taps[:num_rows], torch.cat(expected_taps))
    for field, name in enumerate(("context_positions", "context_seq_indices", "context_slots")):
        expected = torch.cat([rows[field] for rows in expected_rows])
        assert torch.equal(getattr(buffers, name)[:num_rows], expected)
