"""`dflash plan` end to end: the issue's reference figures, JSON keys, and one-line errors."""

import json
import subprocess
import sys

import pytest
from tiers import ROOT

from dflash_cli.main import main

EXAMPLES = ROOT / "examples"
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
    assert plan["paged"]["concurrent_requests"] == plan["paged"]["uncapped_requests"] == 62  # 7992 // 128
    # 64 x 32768 x 20480 bytes is exactly 40 GiB: the dense baseline leaves no target pool at all
    assert plan["dense"]["draft_context_bytes"] == 64 * 32768 * 20_480
    assert plan["dense"]["num_blocks"] == 0


def test_max_num_seqs_caps_paged_and_dense_alike(capsys):
    args = [*BASE, "--memory", "80GiB", "--avg-seq-len", "1000", "--json"]
    args[args.index("--max-model-len") + 1], args[args.index("--max-num-seqs") + 1] = "8192", "8"
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    # paged: 80 GiB // (32 x 167,936) = 15,984 blocks; 1000 tokens take 32 blocks: 499 requests
    assert plan["paged"]["num_blocks"] == 15_984 and plan["paged"]["uncapped_requests"] == 499
    # dense: 8 x 8192 x 20,480 = 1.25 GiB reserved; 78.75 GiB // (32 x 147,456) = 17,920 blocks: 560
    assert plan["dense"]["num_blocks"] == 17_920 and plan["dense"]["uncapped_requests"] == 560
    assert plan["paged"]["concurrent_requests"] == plan["dense"]["concurrent_requests"] == 8


def test_fp8_context_reports_the_cap_and_what_the_blocks_hold(capsys):
    assert main([*BASE, "--memory", "40GiB", "--avg-seq-len", "4096", "--context-dtype", "fp8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line}
    # paged: (40 GiB - 40 scale bytes) // (32 x 157,696) = 8,511 blocks; 4096 tokens take 128: 66, cap 64
    assert rows["paged"][-3:] == ["8,511", "272,352", "64"]
    # dense: 64 x 32768 x 10,240 = 20 GiB reserved; 20 GiB // (32 x 147,456) = 4,551 blocks: 35
    assert rows["dense"][-3:] == ["4,551", "145,632", "35"]
    assert ("(paged: the blocks hold 66 requests of 4096 tokens; max_num_seqs 64 caps how many run at once)"
            in lines)
    assert "(dense:" not in rows  # 35 < 64: nothing capped


def test_an_fp8_target_cache_halves_the_target_bytes_and_leaves_the_context_alone(capsys):
    assert main([*BASE, "--memory", "40GiB", "--kv-cache-dtype", "fp8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # 36 layers x (K, V) x 8 heads x 128 dims x 1 byte; the context stays bf16 (5 x 2 x 8 x 128 x 2)
    assert plan["target_bytes_per_token"] == 36 * 2 * 8 * 128 == 73_728
    assert plan["draft_bytes_per_token"] == 20_480
    # (40 GiB - 36 x 2 x 4 bytes of fp32 scales) // (32 x 94,208) = 14,246 blocks
    assert plan["num_blocks"] == (40 * 2**30 - 36 * 2 * 4) // (32 * 94_208) == 14_246


def test_a_dense_reservation_of_the_whole_budget_is_said_in_words(capsys):
    assert main([*BASE, "--memory", "40GiB", "--avg-seq-len", "4096"]) == 0
    dense = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dense"))
    assert dense.split(maxsplit=3)[1:] == [
        "40.00", "GiB", "no target pool: the dense reservation takes the whole budget; nothing can run"]


def test_a_dense_reservation_leaving_less_than_a_block_is_said_in_words(capsys):
    assert main([*BASE, "--memory", str(40 * 2**30 + 2**20)]) == 0  # 1 MiB beside the 40 GiB reservation
    dense = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dense"))
    # one target-only block: 32 x 147,456 bytes = 4.50 MiB
    assert dense.endswith("no target pool: the 1.00 MiB the dense reservation leaves is less than one block "
                          "(4.50 MiB); nothing can run")


def test_plan_table_names_both_storages(capsys):
    assert main([*BASE, "--memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "paged" in out and "dense" in out and "167,936" in out


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--memory", "lots"], "cannot read 'lots' as a size"),
        (["--memory", "40GiB", "--tokens-per-block", "24"], "--tokens-per-block: tokens_per_block must be"),
        (["--memory", "-5GiB"], "--memory: size '-5GiB' must be a positive whole number of bytes"),
        (["--memory", "40GiB", "--avg-seq-len", "-1"], "avg_seq_len must be positive, got -1"),
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
