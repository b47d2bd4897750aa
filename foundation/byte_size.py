"""Human byte sizes for flags and tables: `40GiB`, `512MiB`, `2e9`, `1048576`."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# A sign is read (and then refused as not positive) so "-5GiB" is told it is negative, not unreadable.
_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(text: str | int) -> int:
    """Bytes in `text`; binary units (KiB, MiB, GiB, TiB; K, M, G, T), decimal (KB, MB, GB, TB)."""
    if isinstance(text, int):
        value, unit = float(text), ""
    else:
        match = _PATTERN.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read {text!r} as a size; use bytes or a unit such as 512MiB, 40GiB or 2e9"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    size = value * _UNITS[unit]
    if not math.isfinite(size) or size <= 0 or size != int(size):
        raise ValueError(f"size {text!r} must be a positive whole number of bytes")
    return int(size)


def format_bytes(size: int) -> str:
    """`size` in the largest binary unit that keeps it >= 1 (e.g. 40.00 GiB)."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= factor:
            return f"{size / factor:.2f} {unit}"
    return f"{size} B"
