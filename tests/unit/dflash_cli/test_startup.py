"""Building the parser imports nothing heavy, so `dflash --help` and `dflash admin health` start at once.

The oracle is `sys.modules` of a fresh interpreter, not a stopwatch: a fast machine cannot make
an import of torch look cheap.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tiers import ROOT

HEAVY = ["grpc", "numpy", "ray", "safetensors", "tokenizers", "torch", "transformers", "triton"]
HELPS = [["--help"], ["plan", "--help"], ["admin", "--help"], ["admin", "stats", "--help"],
         ["generate", "--help"], ["kvpool", "--help"], ["train", "drafter", "--help"]]
PROBE = """
import contextlib, io, json, sys
{prelude}
import dflash_cli.main as cli
cli.build_parser()  # every subcommand registered
codes = []
for argv in {helps!r}:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            cli.main(argv)
        except SystemExit as exit_:
            codes.append([exit_.code, "usage: dflash" in out.getvalue()])
heavy = sorted({{name.split(".")[0] for name in sys.modules}} & set({heavy!r}))
print(json.dumps({{"codes": codes, "heavy": heavy}}))
"""


def probe(prelude: str = "") -> dict:
    """Every --help of HELPS in one fresh interpreter: their exit codes, and the heavy modules loaded."""
    code = PROBE.format(prelude=prelude, helps=HELPS, heavy=HEAVY)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_help_of_every_command_imports_no_torch_grpc_or_ray():
    report = probe()
    assert report["codes"] == [[0, True]] * len(HELPS)  # each --help really printed its usage
    assert report["heavy"] == []


def test_the_probe_sees_torch_when_it_is_imported():
    assert "torch" in probe("import target_service.llm")["heavy"]
