"""Shared pieces of the engine tests: tiny checkpoints, an oracle drafter double, and the chi-square
check of sampled counts against an exact distribution."""

from __future__ import annotations

import math
import zlib

import torch
from tiny_checkpoints import write_drafter_checkpoint, write_target_checkpoint

from target_service.llm import LLM


def make_pair(tmp_path, *, arch="qwen3", block_size=8, vocab_size=160, tokenizer=False, **target_fields):
    target = write_target_checkpoint(tmp_path / "target", arch, vocab_size=vocab_size, tokenizer=tokenizer,
                                     seed=int(torch.randint(0, 2**31, ()).item()), **target_fields)
    drafter = write_drafter_checkpoint(tmp_path / "drafter", target, block_size=block_size,
                                       seed=int(torch.randint(0, 2**31, ()).item()))
    return target, drafter


def random_prompts(count: int, vocab_size: int, *, low=1, high=40) -> list[list[int]]:
    lengths = torch.randint(low, high, (count,)).tolist()
    return [torch.randint(3, vocab_size, (n,)).tolist() for n in lengths]


class DraftRecorder:
    """Wraps a DraftControl; keeps every proposal as read back from the target's step buffers."""

    def __init__(self, inner, buffers):
        self.inner, self.buffers, self.drafts = inner, buffers, []
        self.block_size = inner.block_size

    def store_context(self, num_rows: int) -> None:
        self.inner.store_context(num_rows)

    def settle(self) -> None:
        self.inner.settle()

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        self.inner.propose(num_seqs, num_draft, num_block_cols)
        self.drafts.append(self.buffers.draft_tokens[:num_seqs, :num_draft].tolist())


class PositionRecorder(DraftRecorder):
    """Wraps the DFlash drafter: keeps each proposal by (prompt, position), as drafted (before a
    hybrid puts a lookup's tokens over some rows)."""

    def __init__(self, inner, buffers, engine):
        super().__init__(inner, buffers)
        self.engine = engine
        self.proposals: dict[tuple, list[int]] = {}

    def propose(self, num_seqs: int, num_draft: int, num_block_cols: int) -> None:
        self.inner.propose(num_seqs, num_draft, num_block_cols)
        by_index = {seq.seq_index: seq for seq in self.engine.running_sequences()}
        buffers = self.buffers
        rows = zip(buffers.seq_indices[:num_seqs].tolist(), buffers.start_positions[:num_seqs].tolist())
        for row, (seq_index, start) in enumerate(rows):
            key = (tuple(by_index[seq_index].prompt_token_ids), start)
            self.proposals[key] = self.buffers.draft_tokens[row, :num_draft].tolist()


def recorded_reference(target, drafter, prompts, params, **settings):
    """(llm, tokens, recorder): the single-process engine's outputs for `prompts` with every proposal
    recorded, the reference a split of the services must reproduce; the caller closes `llm`."""
    llm = LLM(target, drafter, **settings)
    runner = llm.assembly.runner
    recorder = DraftRecorder(runner.drafter, runner.step_buffers)
    runner.swap_drafter(recorder)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    return llm, tokens, recorder


class OracleDrafter:
    """Wraps the real DraftWorker: records every context write, and proposes the KNOWN target
    continuation (from a target-only reference run) with some drafts corrupted on purpose.

    Since the target agrees with the reference exactly, the engine must accept precisely the
    uncorrupted prefix of each proposal: `expected_accepted` is that count, summed, computed here
    independently of the engine's accept logic. A proposal is counted once its step has run for its
    sequence: with async scheduling a step launched ahead is dropped for a sequence that finished in
    the step before (it starts where that sequence ended), and it is proposed before the host knows
    the step's inputs, so the drafts that may count are worked out from the staged start position.
    """

    def __init__(self, llm: LLM, references: dict[tuple, list[int]], corrupt_every: int = 3):
        self.runner = llm.assembly.runner
        self.inner = self.runner.drafter
        self.engine = llm.engine
        self.references = references  # prompt tuple -> prompt + reference output ids
        self.corrupt_every = corrupt_every
        self.proposals = []  # (seq, start, accepted if the step runs)
        self.stored: dict[int, list[int]] = {}  # seq_id -> context positions written, in order
        self.runner.swap_drafter(self)

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    def _seq_at(self, seq_index: int):
        return next(seq for seq in self.engine.running_sequences() if seq.seq_index == seq_index)

    def store_context(self, num_rows):
        buffers = self.runner.step_buffers
        rows = zip(buffers.context_positions[:num_rows].tolist(),
                   buffers.context_seq_indices[:num_rows].tolist(), buffers.context_slots[:num_rows].tolist())
        for position, seq_index, slot in rows:
            if slot != -1:
                self.stored.setdefault(self._seq_at(seq_index).seq_id, []).append(position)
        self.inner.store_context(num_rows)

    def settle(self):
        self.inner.settle()

    def propose(self, num_seqs, num_speculative_tokens, num_block_cols):
        self.inner.propose(num_seqs, num_speculative_tokens, num_block_cols)  # the real path still runs
        buffers, rows = self.runner.step_buffers, []
        starts, indices = buffers.start_positions[:num_seqs].tolist(), buffers.seq_indices[:num_seqs].tolist()
        for start, seq_index in zip(starts, indices):
            seq = self._seq_at(seq_index)
            reference = self.references[tuple(seq.prompt_token_ids)]
            row, corrupted_at = [], None
            for k in range(1, num_speculative_tokens + 1):
                position = start + k
                token = reference[position] if position < len(reference) else 0
                if zlib.crc32(f"{seq.seq_id}:{position}".encode()) % self.corrupt_every == 0:
                    token = (token + 1) % self.runner.vocab_size
                    corrupted_at = k - 1 if corrupted_at is None else corrupted_at
                row.append(token)
            usable = min(num_speculative_tokens, self._usable(seq, start))
            first_bad = corrupted_at if corrupted_at is not None else num_speculative_tokens
            self.proposals.append((seq, start, min(first_bad, usable)))
            rows.append(row)
        buffers.draft_tokens[:num_seqs, :num_speculative_tokens].copy_(torch.tensor(rows))

    @property
    def expected_accepted(self) -> int:
        return sum(accepted for seq, start, accepted in self.proposals if start < seq.num_computed)

    def _usable(self, seq, start: int) -> int:
        """The drafts that may count for the sequence as it will be when its step starts at `start`
        (the engine may not have read the step before yet: its outputs grow by start - num_computed),
        by hand: min(K, max_model_len - start - 2, remaining - 1), at least 0."""
        if not seq.has_context:
            return 0
        remaining = seq.params.max_tokens - len(seq.output_token_ids) - (start - seq.num_computed)
        limit = min(self.engine.num_speculative_tokens, self.engine.max_model_len - start - 2, remaining - 1)
        return max(0, limit)


def chi_square_against(counts: torch.Tensor, expected: torch.Tensor, z: float = 3.09) -> tuple[float, float]:
    """(chi-square of `counts` against `expected` counts, its upper quantile at z (3.09: p = 0.001)):
    cells expected fewer than 5 times are pooled into one; the quantile is Wilson-Hilferty's."""
    keep = expected >= 5
    observed_cells = torch.cat([counts[keep], counts[~keep].sum().view(1)]).double()
    expected_cells = torch.cat([expected[keep], expected[~keep].sum().view(1)]).double()
    chi2 = float(((observed_cells - expected_cells) ** 2 / expected_cells.clamp(min=1e-9)).sum())
    dof = observed_cells.numel() - 1
    return chi2, dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
