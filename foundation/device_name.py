"""Device names a flag may give: `cpu`, `cuda` or `cuda:N`, checked without importing torch.

Pool memory, the engines and training run on these and nothing else, so a name like `tpu` or `mps`
is refused where the flag is validated (naming the flag), instead of failing later inside
`torch.device` or an allocator with a traceback.
"""

from __future__ import annotations

import re

_PATTERN = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")


def check_device_name(name: str) -> str:
    """`name` itself when it is cpu, cuda or cuda:N; a ValueError otherwise."""
    if not _PATTERN.match(name):
        raise ValueError(f"must be cpu, cuda or cuda:N, got {name!r}")
    return name


def cuda_device_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device_name(name: str | None, cuda_devices: int) -> str:
    """`name` checked against `cuda_devices` devices (None: "cuda" when there is one, else "cpu").

    Asking for CUDA without it, or for a device index past the last, is a one-line ValueError.
    """
    if name is None:
        return "cuda" if cuda_devices else "cpu"
    check_device_name(name)
    if name.startswith("cuda") and not cuda_devices:
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    index = int(name.partition(":")[2] or 0)
    if name.startswith("cuda") and index >= cuda_devices:
        have = ("1 CUDA device (cuda:0)" if cuda_devices == 1
                else f"{cuda_devices} CUDA devices (cuda:0..cuda:{cuda_devices - 1})")
        raise ValueError(f"device {name!r} was asked for but this machine has {have}")
    return name


def resolve_device(name: str | None):
    """`resolve_device_name` for this process's CUDA devices, as a torch.device."""
    import torch

    return torch.device(resolve_device_name(name, cuda_device_count()))
