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

from kernels import PAD_SLOT
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM
from target_service.runner.context_rows import SeqTaps, context_rows, select_context_rows
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
    """`kernels.context_rows` (the GPU's path; Triton's interpreter on a CPU) against the torch ops that
    select the rows on a CPU, which the test above checks by hand."""
    from kernels.context_rows import select_context_rows as select_with_kernel
    from target_service.runner.context_rows import per_seq_table, select_context_rows_torch

    rng, device = random.Random(), "cuda" if torch.cuda.is_available() else "cpu"
    for _ in range(30):
        batch, seqs, accepted = _random_step(rng, device)
        expected = select_context_rows_torch(batch, seqs, accepted)
        got = select_with_kernel(batch.tap_indices, batch.positions, batch.slot_mapping,
                                 per_seq_table(seqs, batch.device), accepted)
        for got_rows, expected_rows in zip(got, expected):
            assert got_rows.dtype == expected_rows.dtype
            assert torch.equal(got_rows, expected_rows)


def test_the_host_path_keeps_exactly_the_rows_the_selection_does_not_skip():
    """`context_rows` off a GPU hands over only the kept rows (taps included, in order): the rows of
    the torch reference whose slot is not PAD_SLOT, on random steps."""
    from target_service.runner.context_rows import select_context_rows_torch

    rng = random.Random()
    for _ in range(30):
        batch, seqs, accepted = _random_step(rng, "cpu")
        taps = torch.randn(batch.tap_indices.shape[0], 3)
        positions, seq_indices, slots = select_context_rows_torch(batch, seqs, accepted)
        kept = slots != PAD_SLOT
        got = context_rows(batch, seqs, accepted, taps)
        assert torch.equal(got.taps, taps[kept])
        assert torch.equal(got.positions, positions[kept])
        assert torch.equal(got.seq_indices, seq_indices[kept])
        assert torch.equal(got.slots, slots[kept])
        assert got.count == int(kept.sum())
