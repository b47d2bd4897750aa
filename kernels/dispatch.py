"""Backend choice shared by every kernel entry point.

`auto` runs Triton on CUDA tensors and the torch reference on CPU tensors, so a CPU engine stays
fast even when the Triton interpreter is switched on for the kernel tests. `triton` forces the
kernel (on CPU tensors that needs ``TRITON_INTERPRET=1``); `torch` forces the reference. There is
no silent fallback: a Triton failure on a GPU is an error.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Return "triton" or "torch" for `backend` on tensors living on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return backend
