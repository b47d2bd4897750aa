"""Small host <-> device transfers that never make the host wait for the GPU.

A step moves a few hundred integers each way. From pageable memory CUDA may stage a host-to-device
copy through a wait on the stream, and a device-to-host read (`.tolist()`) always waits for every
kernel queued before it, so the host sat idle while the GPU worked and then the GPU sat idle while
the host packed the next inputs. Pinned memory and `non_blocking` copies queue the transfer and
return at once (torch's pinned allocator keeps a buffer until its copy has run); the host reads a
result only when it needs the values, after the rest of the step is queued.

On a CPU both are plain tensors: nothing is asynchronous and the same code runs in the tests.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (ints or a nested list of them) as a tensor on `device`, queued without a wait."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostReadback:
    """One queued copy of a device tensor to the host; `tolist()` waits for that copy alone.

    Start it as soon as the values are computed and queue more work before reading: the host then
    waits only for the kernels up to the copy, and the GPU goes on with what was queued after it.
    """

    def __init__(self, values: torch.Tensor):
        self._event = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values.clone()

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
