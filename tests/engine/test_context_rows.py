"""The context rows a step stages for the drafter, checked row by row against the sequences.

The engine selects them on the device from the forward's own positions and slots; here each staged
row is checked independently, from the sequence that owns its slot: a kept row sits at a position
the target has committed (below num_computed after acceptance), in the pool slot the sequence's
block table gives that position; a skipped row (PAD_SLOT) lies past the accepted prefix. Every
committed position is stored exactly once.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import make_pair, random_prompts

from drafter_service.step_buffers import StepBufferLayout, StepBuffers
from kernels import PAD_SLOT
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.runner.context_rows import (
    RowSelection,
    SeqTaps,
    context_rows,
    per_seq_table,
    pick_rows,
    select_context_rows,
    stage_context_rows,
)
from target_service.runner.forward_batch import SeqChunk, pack


class ContextChecker:
    """Stands in for the engine's drafter: records the rows each step stages and checks them once
    the step has committed (the engine stages them before the host reads the acceptance). Only for
    an engine without async scheduling: there a step's rows are staged a call before it commits."""

    def __init__(self, llm: LLM):
        self.runner, self.engine = llm.assembly.runner, llm.engine
        self.inner = self.runner.drafter
        self.block_size = self.inner.block_size
        self.stored: dict[int, list[int]] = {}
        self.kept = self.skipped = 0
        self.staged = []
        self.runner.swap_drafter(self)
        step = llm.engine.step

        def checked_step():
            finished = step()
            self.check_staged()
            return finished

        llm.engine.step = checked_step

    def settle(self):
        self.inner.settle()

    def propose(self, *args):
        self.inner.propose(*args)

    def store_context(self, num_rows: int) -> None:
        buffers = self.runner.step_buffers
        by_index = {seq.seq_index: seq for seq in self.engine.running_sequences()}
        rows = zip(buffers.context_positions[:num_rows].tolist(),
                   buffers.context_seq_indices[:num_rows].tolist(), buffers.context_slots[:num_rows].tolist())
        self.staged += [(position, by_index[seq_index], slot) for position, seq_index, slot in rows]
        self.inner.store_context(num_rows)

    def check_staged(self) -> None:
        tpb = self.runner.tokens_per_block
        for position, seq, slot in self.staged:
            if slot == PAD_SLOT:
                assert position >= seq.num_computed, (position, seq.num_computed)
                self.skipped += 1
                continue
            assert position < seq.num_computed
            assert slot == seq.block_table[position // tpb] * tpb + position % tpb
            self.stored.setdefault(seq.seq_id, []).append(position)
            self.kept += 1
        self.staged = []


@pytest.mark.parametrize("storage", ["paged", "dense"])
def test_staged_context_rows_are_the_committed_positions_in_their_own_slots(tmp_path, storage):
    target, drafter = make_pair(tmp_path)
    llm = LLM(str(target), str(drafter), device="cpu", dtype="float32", kv_cache_memory="4MiB",
              tokens_per_block=16, max_num_seqs=5, max_model_len=256, max_num_batched_tokens=48,
              num_speculative_tokens=7, context_storage=storage, enable_prefix_caching=False,
              async_scheduling=False)
    checker = ContextChecker(llm)
    prompts = random_prompts(7, 160, low=5, high=90)  # chunked prefills beside verify blocks
    outputs = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    llm.close()
    # off a GPU only the kept rows are staged (context_rows): no row is stored past an accepted prefix
    assert checker.kept > 0 and checker.skipped == 0
    # every request stored its whole history but the newest token (never run through the target)
    expected = sorted(len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1 for out in outputs)
    assert sorted(len(positions) for positions in checker.stored.values()) == expected
    for positions in checker.stored.values():
        assert positions == list(range(len(positions)))  # each committed position once, in order


def test_select_context_rows_by_hand():
    """Two decodes of 3 rows (accepted 1 and 2; the second's context has a gap) and a prefill chunk
    of 2 rows: kept are the first decode's bonus + 1 draft and the prefill's rows."""
    chunks = [SeqChunk([1, 2, 3], 10, [4], 3, 3), SeqChunk([5, 6, 7], 20, [5, 6], 3, 3),
              SeqChunk([8, 9], 0, [7], 0, 2)]
    batch = pack(chunks, 16)
    seqs = [SeqTaps(3, True, True, 0), SeqTaps(3, True, False, 1), SeqTaps(2, False, True, 2)]
    positions, seq_indices, slots = select_context_rows(batch, seqs, torch.tensor([1, 2]))
    assert positions.tolist() == [10, 11, 12, 20, 21, 22, 0, 1]
    assert seq_indices.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    skipped = [PAD_SLOT] * 4  # the first decode's rejected draft, and all of the second decode
    assert slots.tolist() == [4 * 16 + 10, 4 * 16 + 11, *skipped, 7 * 16, 7 * 16 + 1]


def _random_step(rng: random.Random, device: str, tokens_per_block: int = 16):
    """A packed step of random decodes (verify blocks of one K) then prefill chunks (some with a
    replayed head), random context gaps, random accepted drafts; the SeqTaps the runner would build."""
    num_draft = rng.randint(0, 7)
    chunks, seqs, blocks = [], [], iter(rng.sample(range(400), 400))
    for index in range(rng.randint(0, 5)):  # decodes: the bonus and K drafts, every row tapped
        start = rng.randint(0, 60)
        table = [next(blocks) for _ in range((start + num_draft + 1) // tokens_per_block + 1)]
        chunks.append(SeqChunk([1] * (num_draft + 1), start, table, num_draft + 1, num_draft + 1))
        seqs.append(SeqTaps(num_draft + 1, True, rng.random() < 0.8, index))
    num_decodes = len(chunks)
    for index in range(rng.randint(0 if chunks else 1, 4)):  # prefill chunks: every row tapped
        count, start = rng.randint(1, 40), rng.randint(0, 30)
        table = [next(blocks) for _ in range((start + count) // tokens_per_block + 1)]
        chunks.append(SeqChunk([2] * count, start, table, rng.randint(0, 1), count))
        seqs.append(SeqTaps(count, False, rng.random() < 0.8, num_decodes + index))
    accepted = None  # a step without drafts
    if num_draft and num_decodes:
        accepted = torch.tensor([rng.randint(0, num_draft) for _ in range(num_decodes)], dtype=torch.int64,
                                device=device)
    return pack(chunks, tokens_per_block, device), seqs, accepted


def test_the_selection_kernel_equals_the_torch_ops_on_random_steps():
    """`kernels.context_rows` (the GPU's path; Triton's interpreter on a CPU) against its torch reference,
    which the test above checks by hand: one step, and several steps picked in one launch."""
    from kernels.context_rows import select_context_rows as select_with_kernel
    from kernels.reference.context_rows import select_context_rows as select_with_torch

    rng, device = random.Random(), "cuda" if torch.cuda.is_available() else "cpu"
    for _ in range(20):
        selections = [RowSelection.of(*_random_step(rng, device)) for _ in range(rng.randint(1, 3))]
        table = per_seq_table(selections, device)
        accepted = [s.accepted for s in selections if s.accepted is not None]
        tap_indices, positions, slot_mapping = (torch.cat([getattr(s, name) for s in selections])
                                                for name in ("tap_indices", "positions", "slot_mapping"))
        inputs = (tap_indices, positions, slot_mapping, table, torch.cat(accepted) if accepted else None)
        expected = select_with_torch(*inputs)
        got = select_with_kernel(*inputs)
        for got_rows, expected_rows in zip(got, expected):
            assert got_rows.dtype == expected_rows.dtype
            assert torch.equal(got_rows, expected_rows)


def test_steps_picked_together_equal_each_picked_alone_and_land_in_the_given_rows():
    """`pick_rows` over several held steps (their token rows and accepted counts concatenated) gives
    each step's own selection, in order; with `out`, in its first rows, the rest untouched."""
    rng = random.Random()
    for _ in range(20):
        steps = [_random_step(rng, "cpu") for _ in range(rng.randint(2, 4))]
        alone = [select_context_rows(*step) for step in steps]
        out = tuple(torch.full((400,), -7, dtype=torch.int64) for _ in range(3))
        together = pick_rows([RowSelection.of(*step) for step in steps], out=out)
        num_rows = sum(rows.num_rows for rows in alone)
        for field, got in enumerate(together):
            assert torch.equal(got, torch.cat([rows[field] for rows in alone]))
            assert torch.equal(out[field][:num_rows], got) and bool((out[field][num_rows:] == -7).all())


def test_staging_puts_held_parts_in_order_whichever_form_they_take():
    """`stage_context_rows`: unpicked parts (a GPU's), kept parts (a CPU's) or a mix stage the rows each
    step alone would, in order; parts that disagree with the taps are refused."""
    rng = random.Random()
    buffers = StepBuffers.create(StepBufferLayout(max_num_seqs=4, max_blocks_per_seq=4, max_num_draft=7,
                                                  max_context_rows=512, tap_width=3, tap_dtype="float32"),
                                 "cpu", share=False)
    steps = [_random_step(rng, "cpu") for _ in range(3)]
    alone = [select_context_rows(*step) for step in steps]
    taps = torch.randn(sum(rows.num_rows for rows in alone), 3)
    for forms in (["picked"] * 3, ["unpicked"] * 3, ["unpicked", "picked", "unpicked"]):
        parts = [rows if form == "picked" else RowSelection.of(*step)
                 for form, rows, step in zip(forms, alone, steps)]
        assert stage_context_rows(buffers, taps, parts) == taps.shape[0]
        assert torch.equal(buffers.taps[:taps.shape[0]], taps)
        for field, name in enumerate(("context_positions", "context_seq_indices", "context_slots")):
            expected = torch.cat([rows[field] for rows in alone])
            assert torch.equal(getattr(buffers, name)[:taps.shape[0]], expected)
    with pytest.raises(ValueError, match="the parts hold"):
        stage_context_rows(buffers, taps[1:], [RowSelection.of(*step) for step in steps])


def test_the_host_path_keeps_exactly_the_rows_the_selection_does_not_skip():
    """`context_rows` off a GPU hands over only the kept rows (taps included, in order): the rows of
    the torch reference whose slot is not PAD_SLOT, on random steps."""
    rng = random.Random()
    for _ in range(30):
        batch, seqs, accepted = _random_step(rng, "cpu")
        taps = torch.randn(batch.tap_indices.shape[0], 3)
        positions, seq_indices, slots = select_context_rows(batch, seqs, accepted)
        kept = slots != PAD_SLOT
        got = context_rows(batch, seqs, accepted, taps)
        assert torch.equal(got.taps, taps[kept])
        assert torch.equal(got.rows.positions, positions[kept])
        assert torch.equal(got.rows.seq_indices, seq_indices[kept])
        assert torch.equal(got.rows.slots, slots[kept])
        assert got.count == int(kept.sum())
