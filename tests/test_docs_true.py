"""The docs stay true to the tree: what they cite exists, and the map names everything there is.

- No doc and no source file cites a repository file that does not exist. Every markdown file (but
  the results in bench/results/ themselves) and the Python of the product packages, bench/ and
  tests/ are read for paths from the repository root (`k8s/base/rayservice.yaml`,
  `tests/test_import_flow.py`), bare markdown names (`MODEL_CARD.md`) and dotted module names
  (`kvpool_service.leased_control.LeasedPoolControl`); the markdown also for bare module names
  (`pool_writer.py`) and directories (`k8s/overlays/gpu/`).
- `docs/architecture.md` is the map: it names every package directory (`target_service/engine/`)
  and every module of the product packages by its path (`target_service/engine/scheduler.py`).

Strict but not flaky: a cite starts at a top-level directory of this repository, not inside a longer
path (so `/tmp/bench/x.py`, `$OUT/bench/x.py` and `.ab/base/kernels/x.py` are not cites); patterns
(`*`), placeholders (`{name}`, `<file>`, `FILE.md`) and shell variables name no one file and are
skipped; in Python files bare names and dotted names are read from docstrings and comments only (other
strings name files a program writes), and in tests paths too (tests build trees of their own).
"""

from __future__ import annotations

import ast
import functools
import io
import os
import re
import tokenize
from pathlib import Path

import pytest
from tiers import ROOT

ARCHITECTURE = ROOT / "docs" / "architecture.md"
PRODUCT = ["kernels", "foundation", "kvpool_service", "drafter_service", "target_service", "training",
           "dflash_cli"]
TOP_DIRS = [*PRODUCT, "bench", "tests", "docs", "k8s", "protos", "examples"]
EXTENSIONS = "py|md|json|sh|yaml|yml|proto|txt|csv|png|log|toml|safetensors"
SKIPPED_DIRS = {"__pycache__", "build", "dist", "out"}  # and every hidden one (.git, .venv, ...)
GENERATED = "kvpool_service/proto/"  # made by protos/generate.py; the map names it as one room
PLACEHOLDERS = {"FILE", "NAME", "PATH", "DIR", "OUT"}  # `--out FILE.md` in a usage line

NOT_AFTER = r"(?<![\w./$-])"  # a cite does not continue a longer path, a word or a shell variable
PATH_CITE = re.compile(rf"{NOT_AFTER}((?:{'|'.join(TOP_DIRS)})/[\w./*{{}}<>$-]*)")
FILE_CITE = re.compile(rf".*\w\.(?:{EXTENSIONS})$")
NOT_ONE_FILE = re.compile(r"[*{}<>$]")
BARE_MARKDOWN = re.compile(rf"{NOT_AFTER}([\w-]+\.md)(?![\w/-])")
BARE_MODULE = re.compile(rf"{NOT_AFTER}([a-z_][a-z0-9_]*\.py)\b")
SECTION_CITE = re.compile(  # `architecture.md section 7`, `sections 3, 5 and 6`, `section 7, "As trained"`
    r'architecture\.md,?\s+sections?\s+(\d+(?:(?:,\s*|\s+and\s+)\d+)*)(?:,\s+"([^"]+)")?')
DOTTED = re.compile(rf"{NOT_AFTER}((?:{'|'.join([*PRODUCT, 'bench'])})(?:\.\w+)+)")


# ---- reading ------------------------------------------------------------------------------------


@functools.cache
def repo_files() -> tuple[Path, ...]:
    """Every file of the working tree, outside hidden, tool and build directories."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if not (
            name.startswith(".") or name in SKIPPED_DIRS or name.endswith(".egg-info"))]
        found += [Path(folder, name) for name in files]
    return tuple(found)


def docs() -> list[Path]:
    """Every markdown file but the results themselves: a result's header holds the command as it ran,
    at its commit (the index, `bench/results/README.md`, is a doc like any other)."""
    found = sorted(path for path in repo_files() if path.suffix == ".md")
    return [path for path in found if path.parent != ROOT / "bench" / "results" or path.name == "README.md"]


def sources() -> list[Path]:
    """The Python whose cites are read: the product packages, bench/ and tests/ (generated code left out)."""
    return [path for top in [*PRODUCT, "bench", "tests"] for path in sorted((ROOT / top).rglob("*.py"))
            if GENERATED not in path.relative_to(ROOT).as_posix()]


def prose(path: Path) -> str:
    """What a file says to people: all of a markdown file; a Python file's docstrings and comments."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    nodes = [node for node in ast.walk(ast.parse(text))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docstrings = [ast.get_docstring(node) or "" for node in nodes]
    comments = [token.string for token in tokenize.generate_tokens(io.StringIO(text).readline)
                if token.type == tokenize.COMMENT]
    return "\n".join(docstrings + comments)


def path_cites(text: str) -> set[str]:
    """Repository-relative paths in `text` (trailing punctuation dropped); patterns skipped."""
    cites = {match.group(1).rstrip(".,:;)'\"") for match in PATH_CITE.finditer(text)}
    return {cite for cite in cites if not NOT_ONE_FILE.search(cite)}


def file_cites(text: str) -> set[str]:
    return {cite for cite in path_cites(text) if FILE_CITE.match(cite)}


def bare_markdown(text: str) -> set[str]:
    return {name for name in BARE_MARKDOWN.findall(text) if name.removesuffix(".md") not in PLACEHOLDERS}


# ---- dotted names -------------------------------------------------------------------------------


def module_path(dotted: str) -> tuple[Path | None, list[str]]:
    """The longest module or package prefix of a dotted name, and the attribute names after it."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:end])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[end:]
    return None, parts


def defined_names(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body defines (functions, classes, assignments, imports), and the
    attributes its methods set on `self`."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= {target.attr for target in ast.walk(node) if isinstance(target, ast.Attribute)
                      and isinstance(target.ctx, ast.Store) and isinstance(target.value, ast.Name)
                      and target.value.id == "self"}
    return names


def dotted_name_exists(dotted: str) -> bool:
    """`pkg.module[.Name[.member]]`: the module exists, and so does each name asked of it."""
    path, attributes = module_path(dotted)
    if path is None or path.relative_to(ROOT).parts[0] != dotted.split(".")[0]:
        return False
    body = ast.parse(path.read_text()).body
    for name in attributes:
        names = defined_names(body)
        if "__getattr__" in names:
            return True  # a lazy module (target_service's `LLM`) answers for its names itself
        if name not in names:
            return False
        classes = [node for node in body if isinstance(node, ast.ClassDef) and node.name == name]
        if not classes:
            return True  # a function's or a value's own attributes are not the docs' business
        body = classes[0].body
    return True


# ---- no cite of what is not there ---------------------------------------------------------------


def test_code_and_docs_cite_only_files_that_exist():
    names = {path.name for path in repo_files()}
    missing = []
    for path in docs() + sources():
        where = path.relative_to(ROOT)
        text = prose(path) if where.parts[0] == "tests" else path.read_text()
        missing += [f"{where}: {cite}" for cite in sorted(file_cites(text)) if not (ROOT / cite).exists()]
        missing += [f"{where}: {name}" for name in sorted(bare_markdown(prose(path))) if name not in names]
    assert not missing, "cites of files that do not exist:\n" + "\n".join(missing)


def test_code_and_docs_name_only_modules_that_exist():
    python_names = {path.name for path in repo_files() if path.suffix == ".py"}
    missing = []
    for path in docs() + sources():
        where, text = path.relative_to(ROOT), prose(path)
        dotted = sorted(set(DOTTED.findall(text)))
        missing += [f"{where}: {name}" for name in dotted if not dotted_name_exists(name)]
        if path.suffix == ".md":
            bare = set(BARE_MODULE.findall(text))
            missing += [f"{where}: {name}" for name in sorted(bare) if name not in python_names]
    assert not missing, "names of modules (or their members) that do not exist:\n" + "\n".join(missing)


def test_docs_name_only_directories_that_exist():
    missing = [f"{path.relative_to(ROOT)}: {cite}" for path in docs()
               for cite in sorted(path_cites(path.read_text()))
               if cite.endswith("/") and not (ROOT / cite).is_dir()]
    assert not missing, "directories the docs name that do not exist:\n" + "\n".join(missing)


def test_cites_of_the_map_name_its_sections():
    text = ARCHITECTURE.read_text()
    numbers = set(re.findall(r"(?m)^## (\d+)\. ", text))
    titles = set(re.findall(r"(?m)^###+ (.+)$", text))
    wrong = []
    for path in docs() + sources():
        for match in SECTION_CITE.finditer(prose(path)):
            cited, title = set(re.findall(r"\d+", match.group(1))), match.group(2)
            if cited - numbers or (title is not None and title not in titles):
                wrong.append(f"{path.relative_to(ROOT)}: {' '.join(match.group(0).split())}")
    assert not wrong, "cites of docs/architecture.md sections it does not have:\n" + "\n".join(wrong)


# `Name`, `Name(...)`, `Name.member`: a class name (capitalised, then lower case) opening a code span
CLASS_CITE = re.compile(r"`([A-Z][a-z0-9]+[A-Za-z0-9]*)(?:\.(\w+))?[`(.]")
NOT_CLASSES = {"True", "False", "None"}


@functools.cache
def class_bodies() -> dict[str, list[list[ast.stmt]]]:
    """Every class of the product packages by name (several classes may share one), and every other
    top-level name (with an empty body)."""
    found: dict[str, list[list[ast.stmt]]] = {}
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            if GENERATED in path.relative_to(ROOT).as_posix():
                continue
            body = ast.parse(path.read_text()).body
            for node in body:
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(node.body)
            for name in defined_names(body):
                found.setdefault(name, [])
    return found


def test_the_docs_name_only_classes_and_members_that_exist():
    """`BlockManager`, `TargetAssembler(plan)`, `Scheduler.schedule_ahead` in README.md and docs/:
    the class is defined in a product package, and so is the member asked of it."""
    known = class_bodies()
    wrong = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name, member in sorted(set(CLASS_CITE.findall(path.read_text()))):
            if name in NOT_CLASSES or (ROOT / name).exists():  # `None`, `Dockerfile`
                continue
            bodies = known.get(name)
            if bodies is None or (member and bodies and not any(member in defined_names(b) for b in bodies)):
                wrong.append(f"{path.relative_to(ROOT)}: {name}{'.' + member if member else ''}")
    assert not wrong, "classes or members the docs name that do not exist:\n" + "\n".join(wrong)


# ---- the map names everything -------------------------------------------------------------------


def test_the_map_names_every_package_and_room():
    text = ARCHITECTURE.read_text()
    packages = sorted({path.parent.relative_to(ROOT).as_posix() for top in PRODUCT
                       for path in (ROOT / top).rglob("__init__.py")})
    packages += sorted(path.parent.name for path in ROOT.glob("*/__init__.py")
                       if path.parent.name not in PRODUCT)
    unnamed = [package for package in packages if f"`{package}/`" not in text]
    assert not unnamed, "packages docs/architecture.md does not name (as `pkg/`):\n" + "\n".join(unnamed)


def test_the_map_names_every_module_by_its_path():
    named = file_cites(ARCHITECTURE.read_text())
    modules = sorted(path.relative_to(ROOT).as_posix() for top in PRODUCT
                     for path in (ROOT / top).rglob("*.py")
                     if path.name != "__init__.py" and GENERATED not in path.relative_to(ROOT).as_posix())
    unnamed = [module for module in modules if module not in named]
    assert not unnamed, "modules docs/architecture.md does not name:\n" + "\n".join(unnamed)


# ---- the readers themselves ---------------------------------------------------------------------


@pytest.mark.parametrize(("text", "cites"), [
    ("see `docs/architecture.md`.", {"docs/architecture.md"}),
    ("(tests/test_import_flow.py)", {"tests/test_import_flow.py"}),
    ("/tmp/bench/x.py $OUT/bench/y.py .ab/base/kernels/z.py", set()),
    ("bench/results/e2e_step_h200_fp8.* and git show BASE:kernels/<file>.py", set()),
    ('f"bench/results/{name}.json"', set()),
    ("k8s/overlays/gpu/ and bench/results/NAME", set()),
])
def test_a_cite_is_one_file_named_from_the_root(text, cites):
    assert file_cites(text) == cites


def test_bare_markdown_names_exclude_paths_and_placeholders():
    text = "see dflash.md, docs/architecture.md, ../README.md and --out FILE.md"
    assert bare_markdown(text) == {"dflash.md"}


def test_prose_of_python_is_its_docstrings_and_comments(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text('"""Cites a.md."""\n\nOUT = "written.md"  # and b.md\n')
    assert bare_markdown(prose(source)) == {"a.md", "b.md"}


def test_a_section_cite_names_its_numbers_and_title():
    text = 'docs/architecture.md sections 3, 5 and 6; architecture.md section 7, "As trained"'
    found = SECTION_CITE.findall(text)
    assert found == [("3, 5 and 6", ""), ("7", "As trained")]


def test_a_class_cite_is_a_camel_case_name_opening_a_code_span():
    text = '`BlockManager`, `TargetAssembler(plan)`, `Scheduler.schedule_ahead`, `proxy_location="HeadOnly"`'
    assert sorted(CLASS_CITE.findall(text)) == [("BlockManager", ""), ("Scheduler", "schedule_ahead"),
                                                ("TargetAssembler", "")]


def test_a_dotted_name_resolves_to_its_module_and_members():
    assert dotted_name_exists("target_service.assembly.in_process.build_engine")
    assert dotted_name_exists("target_service.engine.engine.LLMEngine.step")
    assert dotted_name_exists("target_service.engine.engine.LLMEngine.stats")  # set in __init__
    assert dotted_name_exists("kvpool_service.control")
    assert not dotted_name_exists("target_service.runner.step_ahead")
    assert not dotted_name_exists("target_service.engine.engine.LLMEngine.no_such_method")
