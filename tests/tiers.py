"""Where the repository and its tests are, and the tiers the tests come in (docs/architecture.md
section 10): the first folder under tests/ names a test's tier, and its marker."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TIERS = ("unit", "engine", "multiprocess", "serving", "cluster", "k8s")


def tier_of(path: Path) -> str | None:
    """The tier a test file belongs to: the first folder under tests/ (None for the house's rules)."""
    parts = path.resolve().relative_to(TESTS).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None
