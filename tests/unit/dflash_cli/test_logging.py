"""The CLI logs warnings and errors only, unless asked: -v for INFO, -vv for DEBUG, -q for errors only,
before or after the subcommand. `dflash generate` of a tiny pair prints its answer and nothing else."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import ROOT
from tiny_checkpoints import write_drafter_checkpoint, write_target_checkpoint

import dflash_cli.main as cli
from dflash_cli.flags import log_level, walk_parsers


def generate(target: Path, drafter: Path, *flags: str) -> subprocess.CompletedProcess:
    argv = ["generate", "--target", target, "--drafter", drafter, "--prompt-ids", "5,6,7",
            "--max-tokens", "4", "--device", "cpu", *flags]
    # -m from the repository root: this checkout's dflash_cli, whatever is installed. A step slower than
    # the slow-step threshold logs a WARNING (target_service.engine.slow_steps), which on a busy CI host
    # one did: these runs are about the log level, so the threshold is put out of reach.
    env = {**os.environ, "DFLASH_SLOW_STEP_MS": "1000000"}
    return subprocess.run([sys.executable, "-m", "dflash_cli.main", *map(str, argv)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, env=env)


def test_generate_logs_nothing_by_default_and_info_with_v(tmp_path):
    target = write_target_checkpoint(tmp_path / "target")
    drafter = write_drafter_checkpoint(tmp_path / "drafter", target)
    quiet = generate(target, drafter)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "" and "finish: length" in quiet.stdout
    verbose = generate(target, drafter, "-v")
    assert verbose.returncode == 0, verbose.stderr
    lines = verbose.stderr.splitlines()
    assert lines and all(line.startswith("INFO ") for line in lines), lines
    assert any(line.startswith(f"INFO foundation.weights: loading {target}") for line in lines)
    assert verbose.stdout.splitlines()[0] == quiet.stdout.splitlines()[0]  # the same tokens either way


# Each leaf subcommand with its required flags (values need not be valid: nothing runs).
LEAVES = {
    "plan": ["--target", "t", "--drafter", "d", "--memory", "1", "--max-model-len", "1",
             "--max-num-seqs", "1"],
    "generate": [],
    "kvpool": ["--target", "t", "--drafter", "d", "--memory", "1"],
    "admin stats": ["--address", "h:1"],
    "admin health": ["--address", "h:1"],
    "train target": ["--out", "o"],
    "train drafter": ["--target", "t", "--out", "o"],
    "serve": [],
    "bench serve": ["--url", "u", "--concurrency", "1"],
    "bench step": [],
}


def test_every_leaf_subcommand_is_covered():
    leaves = [parser.prog.removeprefix("dflash ") for parser, _ in walk_parsers(cli.build_parser())
              if not any(isinstance(action, argparse._SubParsersAction) for action in parser._actions)]
    assert sorted(leaves) == sorted(LEAVES)


@pytest.mark.parametrize("leaf", LEAVES)
@pytest.mark.parametrize("before, after, level", [
    ([], [], logging.WARNING), ([], ["-v"], logging.INFO), (["-v"], [], logging.INFO),
    (["-v"], ["-v"], logging.DEBUG), ([], ["-vv"], logging.DEBUG), ([], ["-q"], logging.ERROR),
    (["-q"], [], logging.ERROR), (["-q"], ["-v"], logging.WARNING),
])
def test_v_and_q_work_before_and_after_every_subcommand(leaf, before, after, level):
    args = cli.build_parser().parse_args([*before, *leaf.split(), *LEAVES[leaf], *after])
    assert log_level(args) == level
