"""Checks on the plain integer tensors that carry step metadata (batches, step buffers).

Both services build frozen batch objects from integer tensors (`ForwardBatch` on the target side,
`DraftBatch` on the drafter's); they check them once, at construction, with the same words.
"""

from __future__ import annotations

import torch

ANY_INT = (torch.int32, torch.int64)
KERNEL_INT = (torch.int32,)  # what the attention kernels read


def check_int_tensor(owner: str, name: str, tensor, dim: int, dtypes=ANY_INT) -> None:
    """Step metadata is plain integer tensors: `owner.name` must be a `dim`-d tensor of `dtypes`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{owner}.{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dim or tensor.dtype not in dtypes:
        allowed = "/".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(
            f"{owner}.{name} must be a {dim}-d {allowed} tensor, got {tensor.dim()}-d {tensor.dtype}"
        )
