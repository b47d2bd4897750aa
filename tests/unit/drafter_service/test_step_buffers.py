"""Step buffers: fields that never overlap, staging that lands in the views, attach that checks the layout."""

import itertools
import pickle

import pytest
import torch

from drafter_service.step_buffers import ALIGN, StepBufferLayout, StepBuffers

LAYOUT = StepBufferLayout(max_num_seqs=3, max_blocks_per_seq=5, max_num_draft=7, max_context_rows=20,
                          tap_width=24, tap_dtype="float32")


def test_fields_are_aligned_and_disjoint_and_the_buffer_holds_them_all():
    offsets, nbytes = LAYOUT.offsets()
    spans = sorted((offsets[name], offsets[name] + torch.Size(shape).numel() * dtype.itemsize)
                   for name, (shape, dtype) in LAYOUT.fields().items())
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    assert spans[-1][1] <= nbytes
    # taps 20 x 24 fp32 = 1920 bytes -> the next field starts at the next 256-byte boundary, 2048
    assert offsets["context_positions"] == 2048


def test_staging_lands_in_the_views_the_other_side_reads():
    buffers = StepBuffers.create(LAYOUT, "cpu", share=False)
    taps = torch.randn(4, 24)
    assert buffers.stage_context(taps, [5, 6, 7, 8], [2, 2, 0, 0], [37, -1, 3, 4]) == 4
    peer = StepBuffers.attach(buffers.export(), LAYOUT)  # what a drafter maps
    assert torch.equal(peer.taps[:4], taps)
    assert peer.context_slots[:4].tolist() == [37, -1, 3, 4]
    assert peer.context_seq_indices[:4].tolist() == [2, 2, 0, 0]
    columns = buffers.stage_propose([11, 12], [40, 3], [2, 0], [[4, 9, 1], [6]])
    assert columns == 3
    assert peer.block_table[:2, :3].tolist() == [[4, 9, 1], [6, 0, 0]]
    assert peer.bonus_tokens[:2].tolist() == [11, 12] and peer.start_positions[:2].tolist() == [40, 3]
    peer.draft_tokens[1, :2] = torch.tensor([5, 6])
    assert buffers.draft_tokens[1, :2].tolist() == [5, 6]


def test_shared_buffers_are_a_dev_shm_file_that_a_pickled_handle_maps():
    buffers = StepBuffers.create(LAYOUT, "cpu", share=True)
    try:
        handle = pickle.loads(pickle.dumps(buffers.export()))
        assert handle.buffer.shm_path.startswith("/dev/shm/dflash-step-")
        peer = StepBuffers.attach(handle, LAYOUT)
        buffers.bonus_tokens[2] = 99
        assert peer.bonus_tokens[2].item() == 99
    finally:
        buffers.close()


def test_private_buffers_refuse_to_leave_the_process():
    with pytest.raises(TypeError, match="cannot leave its process"):
        pickle.dumps(StepBuffers.create(LAYOUT, "cpu", share=False).export())


def test_attach_names_every_field_that_differs():
    handle = StepBuffers.create(LAYOUT, "cpu", share=False).export()
    other = LAYOUT.model_copy(update={"tap_width": 32, "max_num_draft": 15})
    with pytest.raises(ValueError, match=r"max_num_draft: buffers have 7, expected 15; tap_width: buffers "
                                         r"have 24, expected 32"):
        StepBuffers.attach(handle, other)
    with pytest.raises(TypeError, match="handle must be a StepBuffersHandle, got dict"):
        StepBuffers.attach({}, LAYOUT)


def test_counts_past_the_buffers_are_refused_before_anything_is_written():
    buffers = StepBuffers.create(LAYOUT, "cpu", share=False)
    with pytest.raises(ValueError, match=r"num_rows must be in 0..20 .* got 21"):
        buffers.stage_context(torch.zeros(21, 24), [0] * 21, [0] * 21, [0] * 21)
    with pytest.raises(ValueError, match=r"taps must be \[N, 24\], got \(2, 8\)"):
        buffers.stage_context(torch.zeros(2, 8), [0, 1], [0, 0], [0, 1])
    with pytest.raises(ValueError, match="slots has 1 rows, taps has 2"):
        buffers.stage_context(torch.ones(2, 24), [0, 1], [0, 0], [0])
    with pytest.raises(ValueError, match=r"num_block_cols must be in 1..5 .* got 6"):
        buffers.stage_propose([1], [0], [0], [[1, 2, 3, 4, 5, 6]])
    with pytest.raises(ValueError, match=r"num_seqs must be in 1..3 .* got 4"):
        buffers.check_propose(4, 1, 1)
    with pytest.raises(ValueError, match=r"block table per row: got 2, 2, 1, 2"):
        buffers.stage_propose([1, 2], [0, 5], [0], [[1], [2]])
    assert torch.count_nonzero(buffers.taps) == 0 and torch.count_nonzero(buffers.block_table) == 0


def test_staged_proposals_equal_the_rows_given_and_leave_the_rest_as_it_was():
    """Random rows (block tables of random lengths) land in each field's first rows, tables zero-padded
    to the longest; rows past them and columns past the longest keep what they held."""
    buffers = StepBuffers.create(LAYOUT, "cpu", share=False)
    for field in (buffers.bonus_tokens, buffers.start_positions, buffers.seq_indices, buffers.block_table):
        field.fill_(-7)
    count = int(torch.randint(1, LAYOUT.max_num_seqs + 1, ()).item())
    lengths = torch.randint(1, LAYOUT.max_blocks_per_seq + 1, (count,)).tolist()
    tables = [torch.randint(0, 1000, (n,)).tolist() for n in lengths]
    bonus, starts = torch.randint(0, 50000, (count,)).tolist(), torch.randint(0, 4096, (count,)).tolist()
    indices = torch.randperm(LAYOUT.max_num_seqs)[:count].tolist()
    columns = buffers.stage_propose(bonus, starts, indices, tables)
    assert columns == max(lengths)
    assert buffers.bonus_tokens[:count].tolist() == bonus
    assert buffers.start_positions[:count].tolist() == starts
    assert buffers.seq_indices[:count].tolist() == indices
    assert buffers.block_table[:count, :columns].tolist() == [t + [0] * (columns - len(t)) for t in tables]
    assert bool((buffers.block_table[:count, columns:] == -7).all())
    for field in (buffers.bonus_tokens, buffers.start_positions, buffers.seq_indices, buffers.block_table):
        assert bool((field[count:] == -7).all())
