"""The step bench times the batch it names: with a token budget below B x C the prompts prefill a few
per step while the first ones already decode, and none of them may finish before the timed steps
(an H200 run once reported B 64 ctx 8192 at "acceptance" 3.8: its first sequences had run out of
max_tokens, so fewer than B were stepped)."""

from __future__ import annotations

import pytest
import torch

from dflash_cli.bench.random_pair import write_random_pair
from dflash_cli.bench.simulated_acceptance import SimulatedAcceptance
from dflash_cli.bench.step_timing import engine_case
from foundation.checkpoint_config import load_drafter_config
from target_service.llm import LLM

pytestmark = pytest.mark.slow


def test_a_staggered_prefill_leaves_the_whole_batch_running_for_the_timed_steps(tmp_path):
    batch, context, steps, mean = 32, 512, 4, 6.5
    target, drafter = write_random_pair(tmp_path, "tiny", dtype="float32")
    llm = LLM(str(target), str(drafter), device="cpu", dtype="float32", kv_cache_memory="256MiB",
              max_num_seqs=batch, max_model_len=context + 4 * (steps + 1) * 16 + 64,
              max_num_batched_tokens=context, enable_prefix_caching=False)  # one prompt per step
    k = llm.engine.num_speculative_tokens
    try:
        with SimulatedAcceptance(mean, seed=int(torch.randint(0, 2**31, ()))):
            case = engine_case(llm, batch, context, steps, seed=0)
        assert llm.engine.num_requests == 0  # the bench forgets its requests, finished or not
    finally:
        llm.close()
    timed = case["eager"]
    assert timed["running_at_start"] == batch and timed["preemptions"] == 0
    # Poisson(mean - 1) accepted drafts, capped at K: the expected tokens a sequence emits per step
    poisson = torch.distributions.Poisson(mean - 1)
    expected = 1 + sum(min(n, k) * poisson.log_prob(torch.tensor(float(n))).exp() for n in range(60)).item()
    assert abs(timed["mean_acceptance_length"] - expected) < 0.6


@pytest.mark.parametrize("modes", [["dflash"], ["plain"], ["plain", "dflash"]])
def test_the_step_bench_times_only_the_engines_it_is_asked_for(tmp_path, modes):
    """A comparison of DFlash settings (bench/adaptive_h200.sh) times plain decode once, not per run."""
    import json

    from dflash_cli.bench import step

    batch = int(torch.randint(1, 3, ()))
    step.main(["--geometry", "tiny", "--device", "cpu", "--steps", "2", "--rounds", "1", "--batch-sizes",
               str(batch), "--contexts", "64", "--no-hf", "--modes", *modes, "--out", str(tmp_path),
               "--name", "modes"])
    result = json.loads((tmp_path / "modes.json").read_text())
    assert result["modes"] == modes
    for mode in ("plain", "dflash"):
        assert [case["batch"] for case in result[mode]] == ([batch] if mode in modes else [])


def test_the_token_proposer_modes_time_their_own_engines_and_report_them_beside_ngram(tmp_path):
    """ngram, the hybrid pinned to the lookup, and the free hybrid: each its own engine and cases, K as
    DFlash's; ngram and the pinned hybrid verify K drafts a row every step, so they see the same
    simulated draws (equal acceptance); the report's table gives each mode's tok/s over ngram's from the
    same numbers. (That the pinned hybrid never runs the drafter: tests/unit/bench/test_hybrid_overhead.py.)
    """
    import json
    import re

    from dflash_cli.bench import step

    batch = int(torch.randint(1, 3, ()))
    modes = ["ngram", "hybrid-lookup", "hybrid"]
    step.main(["--geometry", "tiny", "--device", "cpu", "--steps", "3", "--rounds", "1", "--batch-sizes",
               str(batch), "--contexts", "64", "--no-hf", "--modes", *modes, "--out", str(tmp_path),
               "--name", "tokens"])
    result = json.loads((tmp_path / "tokens.json").read_text())
    assert result["plain"] == [] and result["dflash"] == []
    timed = {mode: result[mode][0]["eager"] for mode in modes}
    assert all(result[mode][0]["batch"] == batch for mode in modes)
    _, drafter = write_random_pair(tmp_path / "pair", "tiny", dtype="float32")
    k = load_drafter_config(str(drafter)).block_size - 1  # K as DFlash's: the drafter's block - 1
    assert all(result[f"{mode}_num_speculative_tokens"] == k for mode in modes)
    assert timed["hybrid-lookup"]["mean_acceptance_length"] == timed["ngram"]["mean_acceptance_length"]
    report = (tmp_path / "tokens.md").read_text()
    for mode in modes:
        row = re.search(rf"^\| {mode} \| {batch} \| 64 \| .*$", report, re.MULTILINE).group(0).split("|")
        expected = timed[mode]["tokens_per_s"] / timed["ngram"]["tokens_per_s"]
        assert float(row[7]) == pytest.approx(expected, abs=6e-4)
        assert row[8].strip() == "-"  # no DFlash engine was timed
