"""The speculative step end to end, as a user feels it: ms per step and tokens/s through the engine.

    python -m dflash_cli.bench.step [--geometry qwen3-8b|tiny] [--batch-sizes 1 8 32 64]
        [--contexts 2048 8192 32768] [--steps 16] [--rounds 3] [--simulate-acceptance 6.5] [--no-hf]
        [--no-async-scheduling] [--modes plain dflash ngram hybrid-lookup hybrid]
        [--kv-cache-memory 60GiB] [--limits-max-num-seqs 32 64 256] [--limits-kv-cache-memory 16GiB]
        [--name e2e_step_h200] [--out DIR (default: the current directory)]
    (the same as `dflash bench step ...`)

Writes a random-weight checkpoint pair of the geometry (default Qwen3-8B and its 5-layer DFlash-b16
drafter, `dflash_cli.bench.random_pair`), then for every batch size B and context C that fit the pool:
B random prompts of C tokens are prefilled (timed), then `--steps` steps are timed one by one, with
no synchronisation between them (what serving sees), on an engine without a drafter (plain decode)
and on one with the drafter (the DFlash step, K = block_size - 1), one engine at a time. Each case
is timed from CUDA graphs over `--rounds` rounds and eagerly once, with async scheduling (the next
step queued before this one is read; `--no-async-scheduling` times the engine without it, a run of
its own). HF transformers eager over the same checkpoint is timed in the same run (one decode step
of B sequences after a C-token prefill, and a K+1-token verify), where its dense cache fits.

A random drafter is almost never accepted, so `--simulate-acceptance MEAN` (benchmarks only: it
replaces the engine's accepted-lengths function inside this process, and nothing the server runs can
turn it on) draws each step's accepted count from a Poisson around MEAN - 1, capped at K, so the step's
variable-length paths run at a realistic acceptance and tokens/s is measured, not extrapolated.

Also recorded: kernel launches and busy GPU time of one step (torch profiler), and with the
`--limits-*` flags the DFlash step against max_num_seqs and the pool's size (`dflash_cli.bench.step_limits`).
Results: JSON, markdown and a PNG (tokens/s vs batch: this engine, HF, the goal lines) in --out.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import subprocess
import sys
from pathlib import Path

import torch

from dflash_cli.bench.hf_step import hf_case
from dflash_cli.bench.proposer_modes import TOKEN_MODES, pin_to_lookup, speculative_method, uses_drafter
from dflash_cli.bench.random_pair import add_pair_arguments, device_name, random_pair_for
from dflash_cli.bench.simulated_acceptance import CURVES, SimulatedAcceptance
from dflash_cli.bench.step_limits import limit_configs, limits_sweep
from dflash_cli.bench.step_report import markdown, plot
from dflash_cli.bench.step_timing import engine_case, steps_per_case
from foundation.checkpoint_config import load_drafter_config

logger = logging.getLogger("dflash_cli.bench.step")


def _fits(batch: int, context: int, steps: int, rounds: int, k: int, limits) -> bool:
    """Whether B sequences of C tokens and the steps' new tokens fit the pool without preemption.
    The first prompts may decode while the last ones prefill (a token budget below B x C), so a
    sequence may reach max_model_len; that is what is counted."""
    tokens_per_seq = max(context + steps_per_case(steps, rounds) * (k + 1) + 8, limits.max_model_len)
    need = batch * limits.blocks_for(tokens_per_seq)
    return batch <= limits.max_num_seqs and need <= limits.max_blocks_per_seq


def build_parser() -> argparse.ArgumentParser:
    """The step bench's flags (`dflash bench step` forwards its words here)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_arguments(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--modes", nargs="+", choices=("plain", "dflash", *TOKEN_MODES),
                        default=["plain", "dflash"],
                        help="which engines to time (a comparison of DFlash settings needs plain once; "
                             "ngram, hybrid-lookup and hybrid: `dflash_cli.bench.proposer_modes`)")
    parser.add_argument("--rounds", type=int, default=3, help="timings from CUDA graphs per case")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="queue the next step before this one is read, as `dflash serve` does")
    parser.add_argument("--simulate-acceptance", type=float, default=6.5)
    parser.add_argument("--acceptance-curve", choices=CURVES, default="poisson",
                        help="how accepted drafts are drawn: a Poisson around the mean (capped at the drafts "
                             "verified), or a per-position curve whose K drafts give the mean (what judges "
                             "a step that verifies fewer fairly)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="K of the DFlash engine (default: the drafter's block_size - 1)")
    parser.add_argument("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=None,
                        help="the DFlash engine chooses each step's drafts (default: the engine's default)")
    parser.add_argument("--kv-cache-memory", default=None, help="pool budget (default: the engine's)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the target's K/V pages (fp8: float8 e4m3, half the attention's bytes)")
    parser.add_argument("--limits-max-num-seqs", type=int, nargs="*", default=[],
                        help="also time the DFlash step on engines started with each of these max_num_seqs")
    parser.add_argument("--limits-kv-cache-memory", nargs="*", default=[],
                        help="... and with each of these pool sizes (e.g. 16GiB)")
    parser.add_argument("--limits-batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--limits-context", type=int, default=2048)
    parser.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hf-max-tokens", type=int, default=2**18, help="largest B x C HF is run at")
    parser.add_argument("--name", default="e2e_step")
    parser.add_argument("--out", default=".", help="results directory (default: the current directory)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    from target_service.llm import LLM

    device, dtype, target, drafter = random_pair_for(args)
    max_context = max(args.contexts)
    result = {
        "name": args.name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "command": "python -m dflash_cli.bench.step " + " ".join(argv or sys.argv[1:]),
        "device": device_name(device),
        "torch": torch.__version__,
        "geometry": args.geometry,
        "dtype": dtype,
        "simulate_acceptance": args.simulate_acceptance,
        "acceptance_curve": args.acceptance_curve,
        "adaptive_speculation": args.adaptive_speculation,
        "kv_cache_dtype": args.kv_cache_dtype,
        "async_scheduling": args.async_scheduling,
        "steps": args.steps,
        "rounds": args.rounds,
        "modes": args.modes,
        "plain": [],
        "dflash": [],
        **{mode: [] for mode in TOKEN_MODES if mode in args.modes},
        "hf": [],
        "skipped": [],
    }
    out = Path(args.out)
    block = load_drafter_config(str(drafter)).block_size

    def make_llm(mode: str, max_num_seqs: int, kv_cache_memory: str | None):
        method = speculative_method(mode)
        spec = {}
        if method == "dflash":
            spec = {"num_speculative_tokens": args.num_speculative_tokens,
                    "adaptive_speculation": args.adaptive_speculation}
        elif method is not None:  # a token proposer: the drafter's K unless asked, as DFlash's
            spec = {"speculative_method": method,
                    "num_speculative_tokens": args.num_speculative_tokens or block - 1}
        llm = LLM(
            str(target),
            str(drafter) if uses_drafter(mode) else ("none" if method is None else None),
            device=str(device),
            dtype=dtype,
            enable_prefix_caching=False,
            max_num_seqs=max_num_seqs,
            max_model_len=max(max_context, args.limits_context)
            + steps_per_case(args.steps, args.rounds) * 16 + 64,
            kv_cache_memory=kv_cache_memory,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_batched_tokens=8192,
            async_scheduling=args.async_scheduling,
            seed=args.seed,
            **spec,
        )
        if mode == "hybrid-lookup":
            pin_to_lookup(llm)
        return llm

    def acceptance() -> SimulatedAcceptance:
        # a curve's scale is set for the drafter's whole block, whatever K the engine verifies
        return SimulatedAcceptance(args.simulate_acceptance, args.seed, args.acceptance_curve,
                                   num_positions=block - 1)

    for mode in dict.fromkeys(args.modes):  # one engine at a time: each gets the whole device
        llm = make_llm(mode, max(args.batch_sizes), args.kv_cache_memory)
        engine = llm.engine
        k, vocab = engine.num_speculative_tokens, llm.assembly.runner.vocab_size
        if mode in TOKEN_MODES:
            result[f"{mode}_num_speculative_tokens"] = k
        if mode == "dflash":  # as the engine runs (adaptive is on by default on a GPU), not as asked
            result["num_speculative_tokens"] = k
            result["adaptive_speculation"] = llm.assembly.plan.adaptive_speculation
        result[f"{mode}_pool_blocks"] = engine.pool_limits.num_blocks
        with acceptance():
            for context in args.contexts:
                for batch in args.batch_sizes:
                    if not _fits(batch, context, args.steps, args.rounds, max(k, 15), engine.pool_limits):
                        result["skipped"].append(
                            {"mode": mode, "batch": batch, "context": context, "why": "pool too small"}
                        )
                        continue
                    result[mode].append(engine_case(llm, batch, context, args.steps, args.seed, args.rounds))
                    result[mode][-1]["decode_steps_by_drafts"] = engine.counters().decode_steps_by_drafts
                    logger.info("%s %s", mode, json.dumps(result[mode][-1]))
                    _save(result, out, plot_too=False)  # a run cut short keeps what it measured
        llm.close()
        del llm, engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    configs = limit_configs(args.limits_max_num_seqs, args.limits_kv_cache_memory,
                            default_seqs=max(args.batch_sizes), default_memory=args.kv_cache_memory)
    if configs:
        def case(llm, batch, context):
            return engine_case(llm, batch, context, args.steps, args.seed, args.rounds)

        with acceptance():
            result["limits"] = limits_sweep(lambda seqs, memory: make_llm("dflash", seqs, memory), case,
                                            configs, args.limits_batch_sizes, args.limits_context)
        _save(result, out, plot_too=False)
    if args.hf:
        from transformers import AutoModelForCausalLM

        model = (
            AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, dtype)).to(device).eval()
        )
        k = result.get("num_speculative_tokens", 15)
        for case in result["dflash"]:
            if case["batch"] * case["context"] > args.hf_max_tokens:
                continue
            result["hf"].append(
                {
                    "batch": case["batch"],
                    "context": case["context"],
                    **hf_case(model, case["batch"], case["context"], k, vocab, args.steps, args.seed),
                }
            )
            logger.info("hf %s", json.dumps(result["hf"][-1]))
            _save(result, out, plot_too=False)
        del model
    _save(result, out, plot_too=True)
    print((out / f"{args.name}.md").read_text())


def _save(result: dict, out: Path, *, plot_too: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = result["name"]
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    if plot_too:
        plot(result, out / f"{name}.png")


if __name__ == "__main__":
    main()
