"""DraftBatch: the per-step metadata the target hands the drafter for `propose`.

Plain integer tensors only; the DraftWorker builds it from views of the step buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.tensor_checks import ANY_INT, KERNEL_INT, check_int_tensor


@dataclass(frozen=True)
class DraftBatch:
    """B sequences drafting one block each.

    bonus_tokens [B]: the newest committed token of each sequence (position 0 of its noise block).
    start_positions [B]: the bonus token's position; the block covers start..start+K.
    block_table [B, max_blocks] int32: the sequences' block ids (the draft group shares them).
    ctx_lens [B] int32: stored context entries, positions 0..ctx_len-1 (normally ctx_len == start).
    """

    bonus_tokens: torch.Tensor
    start_positions: torch.Tensor
    block_table: torch.Tensor
    ctx_lens: torch.Tensor

    def __post_init__(self):
        for name in self.__dataclass_fields__:
            tensor = getattr(self, name)
            dim = 2 if name == "block_table" else 1
            dtypes = KERNEL_INT if name in ("block_table", "ctx_lens") else ANY_INT
            check_int_tensor("DraftBatch", name, tensor, dim, dtypes)
            if tensor.shape[0] != self.bonus_tokens.shape[0]:
                raise ValueError(
                    f"DraftBatch.{name} has {tensor.shape[0]} rows, "
                    f"bonus_tokens has {self.bonus_tokens.shape[0]}"
                )

    @property
    def num_seqs(self) -> int:
        return self.bonus_tokens.shape[0]

    def to(self, device: torch.device | str) -> DraftBatch:
        return DraftBatch(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})
