"""One line from a pydantic `ValidationError`: the first problem, named by its field.

Settings, configs and CLI flags are pydantic models; their errors are multi-line reports meant for
developers. Users get one line naming what is wrong (and the value, where pydantic's own message
lacks it); each boundary says how a field is named to its users (a flag, a config field, a keyword).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError


def first_problem(error: ValidationError) -> tuple[str, str]:
    """(field, message) of the first problem; the field is "" for a check of the whole model."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] not in ("value_error", "missing"):  # pydantic's own ("should be >= 1") lack the value
        message += f", got {first.get('input')!r}"
    return field, message


def describe(error: ValidationError, name: Callable[[str], str] = str) -> str:
    """`name(field): message` of the first problem; a check of the whole model is its message alone."""
    field, message = first_problem(error)
    return f"{name(field)}: {message}" if field else message


class InvalidSetting(ValueError):
    """A setting refused, as one line (`field: message`); `field` lets a boundary rename it (a flag)."""

    def __init__(self, error: ValidationError):
        self.field, self.message = first_problem(error)
        super().__init__(describe(error))
