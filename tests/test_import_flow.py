"""The house's import rules, read from the source with `ast` (every import, also those inside functions):

- imports flow one way: kernels <- foundation <- kvpool_service <- drafter_service <- target_service
  <- training <- dflash_cli; a package imports only packages below it;
- kernels imports nothing of the project (it must run where only torch and triton are);
- in target_service, only the assemblers touch the pool's BlockManager or the drafter's model: the
  engine and everything else see `PoolControl` and `DraftControl`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["kernels", "foundation", "kvpool_service", "drafter_service", "target_service", "training",
          "dflash_cli"]
TARGET_ASSEMBLERS = {"target_service/assembly/in_process.py", "target_service/assembly/assembler.py"}
# What only an assembler may name: the concrete pool manager, the draft model and its loaders.
ASSEMBLER_ONLY = {
    "kvpool_service.block_manager": {"BlockManager"},
    "drafter_service.model": {"DFlashDrafter"},
    "drafter_service.checkpoint": {"load_drafter"},
    "drafter_service.draft_worker": {"DraftWorker"},
}


def imported_modules(path: Path) -> list[tuple[str, set[str]]]:
    """(module, names imported from it) for every import statement in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, set()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, {alias.name for alias in node.names}))
    return found


def package_files(package: str) -> list[Path]:
    return sorted(path for path in (ROOT / package).rglob("*.py") if "proto" not in path.parts)


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_packages_below_it(package):
    below = set(LAYERS[: LAYERS.index(package)])
    above = set(LAYERS) - below - {package}
    wrong = [f"{path.relative_to(ROOT)}: {module}" for path in package_files(package)
             for module, _ in imported_modules(path) if module.split(".")[0] in above]
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


def test_outside_its_assemblers_target_service_sees_only_the_protocols():
    wrong = []
    for path in package_files("target_service"):
        name = str(path.relative_to(ROOT))
        if name in TARGET_ASSEMBLERS:
            continue
        for module, names in imported_modules(path):
            if module in ASSEMBLER_ONLY and (not names or names & ASSEMBLER_ONLY[module]):
                wrong.append(f"{name}: {module} {sorted(names)}")
    assert not wrong, "target_service reaches past PoolControl / DraftControl:\n" + "\n".join(wrong)


def test_the_rule_reads_imports_inside_functions_too(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("def f():\n    from kvpool_service.block_manager import BlockManager\n")
    assert imported_modules(source) == [("kvpool_service.block_manager", {"BlockManager"})]
