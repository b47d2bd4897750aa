"""The engine's room keeps its state to itself, read from the source with `ast`.

Outside `target_service/engine/` no code (the rest of target_service, training, the CLI, the
benches) reaches through the engine: it never names the engine's or the scheduler's private
attributes (every `self._x` that a class of the engine's room assigns), nor the attributes that
once exposed its insides (`.scheduler`, `.sequences`). Everything callers read or do is a
method of the engine; this test keeps it so.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tiers import ROOT

ENGINE_ROOM = ROOT / "target_service" / "engine"
# The packages that may import the engine at all (the import-flow test keeps the others below it).
CALLERS = ["target_service", "training", "dflash_cli", "bench"]
FORMER_INSIDES = {"scheduler", "sequences"}


def private_state(files: list[Path]) -> set[str]:
    """Every `self._name` the engine room's classes assign."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for leaf in ast.walk(target):
                    if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self" and leaf.attr.startswith("_")
                            and not leaf.attr.startswith("__")):
                        names.add(leaf.attr)
    return names


def reach_throughs(source: str, private: set[str]) -> list[tuple[int, str]]:
    """(line, expression) of each access to `private` or a former inside on anything but self."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if node.attr in FORMER_INSIDES or (node.attr in private and not on_self):
            found.append((node.lineno, ast.unparse(node)))
    return found


def caller_files() -> list[Path]:
    files = []
    for package in CALLERS:
        files += [path for path in (ROOT / package).rglob("*.py")
                  if "proto" not in path.parts and ENGINE_ROOM not in path.parents]
    return sorted(files)


def test_the_engine_room_has_private_state_to_guard():
    private = private_state(sorted(ENGINE_ROOM.glob("*.py")))
    assert {"_scheduler", "_runner", "_sequences"} <= private


def test_no_code_outside_the_engine_room_touches_its_private_state():
    private = private_state(sorted(ENGINE_ROOM.glob("*.py")))
    wrong = [f"{path.relative_to(ROOT)}:{line}: {expression}" for path in caller_files()
             for line, expression in reach_throughs(path.read_text(), private)]
    assert not wrong, "reaches into the engine:\n" + "\n".join(wrong)


def test_a_reach_through_is_caught():
    source = "n = len(llm.engine.scheduler.running)\nengine._sequences.pop(rid)\nself._runner = r\n"
    assert reach_throughs(source, {"_sequences", "_runner"}) == [
        (1, "llm.engine.scheduler"), (2, "engine._sequences")]
