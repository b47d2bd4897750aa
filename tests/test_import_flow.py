"""The house's import rules, read from the source with `ast` (every import, also those inside functions):

- imports flow one way: kernels <- foundation <- kvpool_service <- drafter_service <- target_service
  <- training <- dflash_cli <- bench; a package imports only packages below it (bench, the lab notebook,
  sits on top of the flow: a benchmark may drive `dflash`, but nothing the wheel installs imports it);
- kernels imports nothing of the project (it must run where only torch and triton are);
- in target_service, only the assemblers touch the pool's BlockManager or the drafter's model: the
  engine and everything else see `PoolControl` and `DraftControl`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tiers import ROOT

LAYERS = ["kernels", "foundation", "kvpool_service", "drafter_service", "target_service", "training",
          "dflash_cli", "bench"]
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


def package_files(package: str, root: Path = ROOT) -> list[Path]:
    return sorted(path for path in (root / package).rglob("*.py") if "proto" not in path.parts)


def imports_against_the_flow(package: str, root: Path = ROOT) -> list[str]:
    """`file: module` for every import in `package` (under `root`) of a package above it in LAYERS."""
    above = set(LAYERS[LAYERS.index(package) + 1:])
    return [f"{path.relative_to(root)}: {module}" for path in package_files(package, root)
            for module, _ in imported_modules(path) if module.split(".")[0] in above]


def test_every_top_level_package_is_in_a_layer():
    """A new package outside LAYERS would import anything unchecked; a renamed one would leave its
    layer empty and its rule true of nothing."""
    packages = sorted(path.parent.name for path in ROOT.glob("*/__init__.py"))
    assert packages == sorted(LAYERS)


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_packages_below_it(package):
    wrong = imports_against_the_flow(package)
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


def test_a_cli_that_imports_a_benchmark_is_a_loop_the_rule_finds(tmp_path):
    cli, bench = tmp_path / "dflash_cli", tmp_path / "bench"
    cli.mkdir()
    bench.mkdir()
    (cli / "ok.py").write_text("import torch\nfrom target_service.llm import LLM\n")
    (cli / "loop.py").write_text("def run():\n    from bench.bench_serve_modes import run\n")
    (bench / "drives_the_cli.py").write_text("from dflash_cli.main import main\n")
    assert imports_against_the_flow("dflash_cli", tmp_path) == ["dflash_cli/loop.py: bench.bench_serve_modes"]
    assert imports_against_the_flow("bench", tmp_path) == []  # downwards: allowed


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
