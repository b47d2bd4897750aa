"""ForwardBatch: the metadata of one packed target forward (prefill chunks, verify blocks, decodes).

Plain tensors and nothing else, so it pickles across a process boundary and can be built on the
host before a CUDA graph replays. Names follow vLLM / flash-attn (`slot_mapping`, `seq_lens`,
`query_start_loc`, `logits_indices`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from foundation.host_transfer import to_device
from foundation.tensor_checks import ANY_INT, KERNEL_INT, check_int_tensor
from kernels import PAD_SLOT


def _check_int(name: str, tensor, dim: int, dtypes=ANY_INT) -> None:
    check_int_tensor("ForwardBatch", name, tensor, dim, dtypes)


@dataclass(frozen=True)
class ForwardBatch:
    """T packed tokens of B sequences; sequence b owns rows query_start_loc[b]:query_start_loc[b+1].

    Fields (all integer tensors on the model's device):
      input_ids [T], positions [T]: the tokens and their absolute positions.
      slot_mapping [T]: block * tokens_per_block + offset where each token's K/V goes (-1 skips).
      block_table [B, max_blocks] int32, seq_lens [B] int32 (tokens incl. this step's),
      query_start_loc [B+1] int32: what `kernels.paged_attention` reads.
      logits_indices [R]: rows of T whose logits are returned (in this order).
      tap_indices [R']: rows of T whose tapped hidden states are returned (empty: none).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    tap_indices: torch.Tensor

    def __post_init__(self):
        for name in ("input_ids", "positions", "slot_mapping", "logits_indices", "tap_indices"):
            _check_int(name, getattr(self, name), 1)
        _check_int("seq_lens", self.seq_lens, 1, KERNEL_INT)
        _check_int("query_start_loc", self.query_start_loc, 1, KERNEL_INT)
        _check_int("block_table", self.block_table, 2, KERNEL_INT)
        num_tokens, num_seqs = self.num_tokens, self.num_seqs
        for name in ("positions", "slot_mapping"):
            if getattr(self, name).shape[0] != num_tokens:
                raise ValueError(
                    f"ForwardBatch.{name} has {getattr(self, name).shape[0]} rows, input_ids has {num_tokens}"
                )
        if self.block_table.shape[0] != num_seqs or self.query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(
                f"ForwardBatch: block_table has {self.block_table.shape[0]} rows and query_start_loc "
                f"{self.query_start_loc.shape[0]} entries; seq_lens says {num_seqs} sequences "
                f"(expected {num_seqs} and {num_seqs + 1})"
            )
        devices = {getattr(self, name).device for name in self.__dataclass_fields__}
        if len(devices) > 1:
            raise ValueError(f"ForwardBatch tensors live on several devices: {sorted(map(str, devices))}")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str) -> ForwardBatch:
        return ForwardBatch(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: `token_ids` at positions start, start+1, ...

    block_table covers at least positions 0..start+len(token_ids)-1. The last `num_logits` rows get
    logits (1 for a decode or the final prefill chunk, len for a verify block, 0 for an inner
    prefill chunk, more for a chunk whose prompt logprobs are asked); the last `num_taps` rows get
    tapped hidden states. The first `num_replayed` rows are in the pages already: they run (for their
    logits) but store nothing (slot PAD_SLOT), so the pages they read stay as they are.
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    num_logits: int = 1
    num_taps: int = 0
    num_replayed: int = 0

    def __post_init__(self):
        count = len(self.token_ids)
        if count == 0:
            raise ValueError("SeqChunk.token_ids is empty; a chunk schedules at least one token")
        if self.start < 0:
            raise ValueError(f"SeqChunk.start must be >= 0, got {self.start}")
        for name in ("num_logits", "num_taps", "num_replayed"):
            if not 0 <= getattr(self, name) <= count:
                raise ValueError(f"SeqChunk.{name} must be in 0..{count}, got {getattr(self, name)}")


def pack(
    chunks: Sequence[SeqChunk], tokens_per_block: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Pack chunks (in order) into one ForwardBatch; the host-side planning of a step."""
    if not chunks:
        raise ValueError("pack needs at least one SeqChunk")
    ids, positions, slots, logits_rows, tap_rows, starts, lens = [], [], [], [], [], [0], []
    max_blocks = max(len(chunk.block_table) for chunk in chunks)
    for chunk in chunks:
        end = chunk.start + len(chunk.token_ids)
        if -(-end // tokens_per_block) > len(chunk.block_table):
            raise ValueError(
                f"SeqChunk.block_table has {len(chunk.block_table)} blocks; positions up to {end - 1} "
                f"need {-(-end // tokens_per_block)} of {tokens_per_block} tokens"
            )
        ids.extend(chunk.token_ids)
        stored_from = chunk.start + chunk.num_replayed
        for pos in range(chunk.start, end):
            positions.append(pos)
            block = chunk.block_table[pos // tokens_per_block]
            slot = block * tokens_per_block + pos % tokens_per_block
            slots.append(slot if pos >= stored_from else PAD_SLOT)
        logits_rows.extend(range(len(ids) - chunk.num_logits, len(ids)))
        tap_rows.extend(range(len(ids) - chunk.num_taps, len(ids)))
        starts.append(len(ids))
        lens.append(end)
    table = []
    for chunk in chunks:
        table += chunk.block_table
        table += [0] * (max_blocks - len(chunk.block_table))
    # Two host-to-device copies (the int64 fields, the int32 ones), sliced into the fields on the device.
    longs = _to_device([ids, positions, slots, logits_rows, tap_rows], torch.int64, device)
    ints = _to_device([lens, starts, table], torch.int32, device)
    num_seqs = len(chunks)
    return ForwardBatch(
        input_ids=longs[0], positions=longs[1], slot_mapping=longs[2], logits_indices=longs[3],
        tap_indices=longs[4], seq_lens=ints[0], query_start_loc=ints[1],
        block_table=ints[2].view(num_seqs, max_blocks),
    )


def _to_device(fields: list[list[int]], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Integer lists as one tensor moved in one queued copy, split back into per-field views."""
    flat = to_device([value for field in fields for value in field], dtype, device)
    return list(flat.split([len(field) for field in fields]))
