"""Every test lives in a tier (docs/architecture.md section 10): a folder under tests/ whose name is
its marker, so `pytest tests/engine` and `pytest -m engine` select the same tests. Only the house's
own rules sit at the top level."""

from __future__ import annotations

from pathlib import Path

from tiers import TESTS, TIERS, tier_of


def test_every_test_file_is_in_a_tier_or_is_a_house_rule():
    stray = [str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py")
             if path.parent != TESTS and tier_of(path) is None]
    assert not stray, "test files outside a tier folder: " + ", ".join(sorted(stray))


def test_each_tier_folder_holds_tests():
    assert all(any((TESTS / tier).rglob("test_*.py")) for tier in TIERS)


def test_a_file_s_tier_is_its_first_folder():
    assert tier_of(TESTS / "unit" / "kernels" / "test_store.py") == "unit"
    assert tier_of(TESTS / "serving" / "test_api.py") == "serving"
    assert tier_of(TESTS / "test_tiers.py") is None
    assert tier_of(TESTS / "target_service" / "test_x.py") is None


def test_the_tier_markers_are_registered(pytestconfig):
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(TIERS) <= registered
    assert Path(__file__).parent == TESTS
