"""Plain-torch oracles of every kernel, with the kernels' signatures.

They are the CPU path of the engine and the reference the kernel tests compare against (next to
the float64 computations the tests write themselves).
"""

from kernels.reference.context_attention import paged_context_attention
from kernels.reference.paged_attention import paged_attention
from kernels.reference.store import store_kv

__all__ = ["paged_attention", "paged_context_attention", "store_kv"]
