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
