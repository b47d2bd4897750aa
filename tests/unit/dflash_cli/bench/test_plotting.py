"""matplotlib is an optional extra: without it `dflash bench serve`, `dflash bench step` and the
benchmarks of bench/ still write their JSON and markdown, skip the PNG and say so in one log line
naming the file and the extra; with it the PNG is drawn. Every PNG writer asks `plotting.pyplot`, so
none of them can need matplotlib where the extra is missing, and the server does not depend on it."""

from __future__ import annotations

import argparse
import ast
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
from tiers import ROOT

from dflash_cli.bench import plotting, serve_report, step
from dflash_cli.bench.serve_load import add_arguments
from dflash_cli.bench.serve_request import RequestResult

PNG = b"\x89PNG"
STEP_RESULT = {"name": "e2e", "device": "cpu", "torch": "-", "commit": "-", "date": "-", "command": "-",
               "geometry": "tiny", "dtype": "float32", "simulate_acceptance": 6.5, "steps": 1,
               "plain": [], "dflash": [], "hf": [], "skipped": []}


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError


def _skip_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == plotting.__name__]


def _serve_args(out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--url", "http://127.0.0.1:1/v1", "--concurrency", "2", "--out", str(out),
                              "--prompts", "random", "--num-prompts", "2", "--input-len", "4",
                              "--output-len", "4"])
    args.command_line = "dflash bench serve ..."
    return args


def test_without_matplotlib_pyplot_is_none_and_says_how_to_get_it(no_matplotlib, caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger=plotting.__name__):
        assert plotting.pyplot(tmp_path / "x.png") is None
    assert _skip_lines(caplog) == [f"{tmp_path / 'x.png'} skipped: matplotlib is not installed "
                                   "(pip install 'dflash-serve[bench]' adds it)"]


def test_serve_results_without_matplotlib_are_json_and_markdown(no_matplotlib, caplog, tmp_path):
    result = {"url": "http://127.0.0.1:1/v1", "model": "m", "settings": []}
    with caplog.at_level(logging.WARNING, logger=plotting.__name__):
        doc = serve_report.write_results(result, _serve_args(tmp_path), "tok")
    assert json.loads((tmp_path / "serve.json").read_text())["model"] == doc["model"] == "m"
    assert (tmp_path / "serve.md").read_text().startswith("# Serving load: serve")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve.json", "serve.md"]
    assert _skip_lines(caplog) == [f"{tmp_path / 'serve.png'} skipped: matplotlib is not installed "
                                   "(pip install 'dflash-serve[bench]' adds it)"]


def test_step_results_without_matplotlib_are_json_and_markdown(no_matplotlib, caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger=plotting.__name__):
        step._save(STEP_RESULT, tmp_path, plot_too=True)
    assert json.loads((tmp_path / "e2e.json").read_text()) == STEP_RESULT
    assert (tmp_path / "e2e.md").read_text().startswith("# End-to-end step: e2e")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e2e.json", "e2e.md"]
    assert len(_skip_lines(caplog)) == 1 and f"{tmp_path / 'e2e.png'} skipped" in _skip_lines(caplog)[0]


def test_a_bench_module_without_matplotlib_redraws_the_markdown_and_names_the_png(no_matplotlib, caplog,
                                                                                   tmp_path):
    from bench.bench_serve_modes_report import markdown, replot

    kept = ROOT / "bench" / "results" / "serve_modes_h200_now.json"
    shutil.copy(kept, tmp_path / kept.name)
    with caplog.at_level(logging.WARNING, logger=plotting.__name__):
        replot(tmp_path / kept.name)
    assert (tmp_path / "serve_modes_h200_now.md").read_text() == markdown(json.loads(kept.read_text()))
    assert not (tmp_path / "serve_modes_h200_now.png").exists()
    assert len(_skip_lines(caplog)) == 1 and "serve_modes_h200_now.png skipped" in _skip_lines(caplog)[0]


def _streamed_result() -> dict:
    """One setting of two passes, each of two streamed requests (three chunks: two gaps each)."""
    requests = [RequestResult(ok=True, sent_at=0.0, chunk_at=[0.02, 0.03, 0.3], e2e=0.3, output_tokens=4)] * 2
    passes = [serve_report.summarize_pass(n, kind, requests, started=0.0, ended=0.3, origin=0.0,
                                          threshold_s=0.25, accepted=None, counters={})
              for n, kind in ((1, "new"), (2, "repeat"))]
    setting = serve_report.summarize_setting("concurrency", 2, requests * 2, 0.6, None, passes)
    return {"url": "http://127.0.0.1:1/v1", "model": "m", "settings": [setting]}


def test_with_matplotlib_the_pngs_are_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    step._save(STEP_RESULT, tmp_path, plot_too=True)
    serve_report.write_results(_streamed_result(), _serve_args(tmp_path), "tok")
    assert (tmp_path / "e2e.png").read_bytes().startswith(PNG)
    assert (tmp_path / "serve.png").read_bytes().startswith(PNG)
    assert (tmp_path / "serve_gaps.png").read_bytes().startswith(PNG)


def test_a_streamed_run_without_matplotlib_names_both_pngs_it_skipped(no_matplotlib, caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger=plotting.__name__):
        serve_report.write_results(_streamed_result(), _serve_args(tmp_path), "tok")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve.json", "serve.md"]
    assert [line.split()[0] for line in _skip_lines(caplog)] == [str(tmp_path / "serve.png"),
                                                                  str(tmp_path / "serve_gaps.png")]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_every_png_writer_of_the_benches_goes_through_plotting():
    sources = sorted(path for top in ("bench", "dflash_cli") for path in (ROOT / top).rglob("*.py"))
    importers = [path.relative_to(ROOT).as_posix() for path in sources
                 if any(name.split(".")[0] == "matplotlib" for name in _imports(path))]
    assert importers == ["dflash_cli/bench/plotting.py"]
    writers = [path for path in sources if ".savefig(" in path.read_text()]
    assert len(writers) >= 6  # the step, serve, serve modes, demo speedup and both attention reports
    assert [p for p in writers if "dflash_cli.bench.plotting" not in _imports(p)] == []


def test_matplotlib_is_the_bench_extra_not_a_dependency_of_the_server():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [dep for dep in project["dependencies"] if dep.startswith("matplotlib")]
    assert project["optional-dependencies"]["bench"] == ["matplotlib>=3.8"]
    assert plotting.EXTRA == "pip install 'dflash-serve[bench]'"
