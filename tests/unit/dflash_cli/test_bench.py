"""`dflash bench`: a bad `bench serve` flag is one line naming it, exit status 2, before any prompt is
made or request sent; `bench step` hands every word but -v/-q to the step bench (dflash_cli.bench.step)
unchanged; building the parser and `--help` of both load neither torch nor httpx; results go to the
current directory unless --out says otherwise."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import pytest
from tiers import ROOT

import dflash_cli.main as cli

URL = ("--url", "http://127.0.0.1:8000/v1")


@pytest.fixture
def dflash(capsys):
    def run(*argv: str) -> tuple[int, str]:
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as exit_:  # argparse's own errors leave through SystemExit
            code = exit_.code
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        return code, err.strip()
    return run


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize("argv, message", [
    ([*URL], "one of the arguments --request-rate --concurrency is required"),
    ([*URL, "--request-rate", "1", "--concurrency", "1"], "argument --concurrency: not allowed with"),
    (["--concurrency", "1"], "the following arguments are required: --url"),
    ([*URL, "--concurrency", "2", "0"], "--concurrency: every level must be at least 1, got [2, 0]"),
    ([*URL, "--request-rate", "0"], "--request-rate: every rate must be > 0 (or inf), got [0.0]"),
    (["--url", "127.0.0.1:8000/v1", "--concurrency", "1"], "--url: expected http(s)://host:port/v1"),
    ([*URL, "--concurrency", "1", "--num-prompts", "0"], "--num-prompts: must be at least 1, got 0"),
    ([*URL, "--concurrency", "1", "--output-len", "-3"], "--output-len: must be at least 1, got -3"),
    ([*URL, "--concurrency", "1", "--prompts", "books"], "argument --prompts: invalid choice: 'books'"),
    ([*URL, "--concurrency", "1", "--api-key-file", "/no/such/key"], "--api-key-file: no file /no/such/key"),
    ([*URL, "--concurrency", "1", "--tokenizer-dir", "/tmp"], "--tokenizer-dir: no tokenizer.json in /tmp"),
])
def test_a_bad_bench_serve_flag_is_one_line_naming_it(dflash, argv, message):
    code, err = dflash("bench", "serve", *argv)
    assert code == 2 and err.startswith("dflash bench") and message in err, err


def test_a_server_that_is_not_there_is_one_line_naming_the_url(dflash, tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    code, err = dflash("bench", "serve", "--url", url, "--concurrency", "1", "--prompts", "random",
                       "--num-prompts", "2", "--no-progress", "--out", tmp_path)
    assert code == 2 and err.startswith(f"dflash bench: error: --url: cannot list the models at {url}")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_bench_step_forwards_every_word_but_v_and_q(monkeypatch):
    import dflash_cli.bench.step

    seen = []
    monkeypatch.setattr(dflash_cli.bench.step, "main", lambda argv: seen.append(argv))
    argv = ["--steps", "8", "--batch-sizes", "1", "8", "--no-hf", "--name", "x", "--out", "/tmp/o"]
    assert cli.main(["bench", "step", *argv[:5], "-v", *argv[5:]]) == 0
    assert seen == [argv]


def test_bench_help_loads_neither_torch_nor_httpx():
    code = """
import contextlib, io, json, sys
import dflash_cli.main as cli
codes = []
for argv in (["bench", "--help"], ["bench", "serve", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            cli.main(argv)
        except SystemExit as exit_:
            codes.append([exit_.code, "--request-rate" in out.getvalue() or "serve" in out.getvalue()])
heavy = {"torch", "httpx", "grpc", "ray", "tokenizers", "numpy", "tqdm", "matplotlib"}
print(json.dumps({"codes": codes, "heavy": sorted({m.split(".")[0] for m in sys.modules} & heavy)}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"codes": [[0, True], [0, True]], "heavy": []}


def test_python_m_serve_load_parses_the_same_flags():
    result = subprocess.run([sys.executable, "-m", "dflash_cli.bench.serve_load", "--help"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0 and "--request-rate R [R ...]" in result.stdout
    assert "--concurrency C [C ...]" in result.stdout


def test_results_go_to_the_current_directory_unless_out_says_otherwise():
    from dflash_cli.bench import serve_load, step

    serve = argparse.ArgumentParser()
    serve_load.add_arguments(serve)
    assert serve.parse_args([*URL, "--concurrency", "1"]).out == "."
    assert step.build_parser().parse_args([]).out == "."
    for parser in (serve, step.build_parser()):
        help_text = " ".join(parser.format_help().split())
        assert "--out OUT results directory (default: the current directory)" in help_text
