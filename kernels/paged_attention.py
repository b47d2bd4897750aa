"""SCAFFOLD (replaced by the Triton implementation): dispatches to the reference only."""

from kernels import reference
from kernels.dispatch import resolve_backend


def paged_attention(*args, backend="auto", **kwargs):
    device = args[0].device
    if resolve_backend(backend, device) == "torch":
        return reference.paged_attention(*args, **kwargs)
    raise NotImplementedError("Triton paged_attention is not written yet")
