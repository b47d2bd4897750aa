"""Tensor math of dflash-serve: Triton kernels, their torch references, shared layers.

Imports only torch and triton. Every entry point takes ``backend="auto"|"triton"|"torch"``
(see `kernels.dispatch`).
"""

from kernels import reference
from kernels.context_attention import paged_context_attention
from kernels.paged_attention import paged_attention
from kernels.store import PAD_SLOT, store_kv

__all__ = ["PAD_SLOT", "paged_attention", "paged_context_attention", "reference", "store_kv"]
