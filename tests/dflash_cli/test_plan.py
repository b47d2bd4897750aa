"""`dflash plan` end to end: the issue's reference figures, JSON keys, and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_cli.main import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BASE = ["plan", "--target", str(EXAMPLES / "qwen3-8b"), "--drafter", str(EXAMPLES / "qwen3-8b-dflash-b16"),
        "--max-model-len", "32768", "--max-num-seqs", "64"]


def test_plan_json_gives_the_reference_figures(capsys):
    assert main([*BASE, "--memory", "40GiB", "--avg-seq-len", "4096", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["target_bytes_per_token"] == 147_456
    assert plan["draft_bytes_per_token"] == 20_480
    assert plan["total_bytes_per_token"] == 167_936
    assert plan["tokens_per_block"] == 32
    assert plan["num_blocks"] == 7_992 and plan["max_tokens"] == 7_992 * 32
    assert plan["paged"]["concurrent_requests"] == 7_992 // 128
    # 64 x 32768 x 20480 bytes is exactly 40 GiB: the dense baseline leaves no target pool at all
    assert plan["dense"]["draft_context_bytes"] == 64 * 32768 * 20_480
    assert plan["dense"]["num_blocks"] == 0


def test_plan_table_names_both_storages(capsys):
    assert main([*BASE, "--memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "paged" in out and "dense" in out and "167,936" in out


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--memory", "lots"], "cannot read 'lots' as a size"),
        (["--memory", "40GiB", "--tokens-per-block", "24"], "tokens_per_block"),
    ],
)
def test_bad_input_is_one_sentence_without_traceback(extra, words):
    result = subprocess.run(
        [sys.executable, "-m", "dflash_cli.main", *BASE, *extra], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert words in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_drafter_for_another_target_is_refused(tmp_path, capsys):
    config = json.loads((EXAMPLES / "qwen3-8b-dflash-b16" / "config.json").read_text())
    config["num_target_layers"] = 28
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = [*BASE, "--memory", "40GiB"]
    args[args.index("--drafter") + 1] = str(tmp_path)
    assert main(args) == 2
    assert "num_target_layers 28" in capsys.readouterr().err
