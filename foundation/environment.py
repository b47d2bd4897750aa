"""Settings an operator gives through the environment (a switch, a number), read in one way: unset or
empty means the default, and a value that is not one of the allowed is a ValueError naming the
variable, never silently the default."""

from __future__ import annotations

import math
import os

SWITCH_VALUES = {"0": False, "1": True}


def env_switch(name: str, default: bool = True) -> bool:
    """`name` as 0 (off) or 1 (on); unset or empty: `default`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if text not in SWITCH_VALUES:
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return SWITCH_VALUES[text]


def env_number(name: str, default: float) -> float:
    """`name` as a finite number >= 0; unset or empty: `default`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a number >= 0, got {text!r}")
    return value
