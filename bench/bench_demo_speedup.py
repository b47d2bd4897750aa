"""Acceptance and batch-1 speedup of a pair (default: the shipped demo pair) on held-out code.

    python -m bench.bench_demo_speedup [--target DIR --drafter DIR] [--prompts 32 --timing-prompts 8]
        [--timing-rounds 5] [--max-tokens 128] [--device cpu] [--dtype float32] [--name speedup_cpu]

Greedy, K = block_size - 1, through the real engine (training.evaluate): DFlash,
prompt lookup and plain decoding on the same held-out prompts of this Python's standard library
(or of `--corpus`: the split hashes paths relative to each root, so a copy of the library splits alike).
Batch-1 speed: `--timing-rounds` rounds, each running every timing prompt through plain decoding,
DFlash and prompt lookup back to back; tokens/s as the median over rounds with min-max, and the
speed-up as the median of per-round ratios (on a shared host the speed swings between runs, a ratio
taken within one round does not). Writes bench/results/<name>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import subprocess
from pathlib import Path

import torch

from dflash_cli.bench.plotting import pyplot
from drafter_service.checkpoint import open_drafter_checkpoint
from target_service.assembly.demo import demo_drafter_path, demo_target_path
from target_service.runner.checkpoint import open_target_checkpoint
from training.corpus import held_out_prompts, load_documents, split_documents
from training.evaluate import evaluate_pair

RESULTS = Path(__file__).resolve().parent / "results"


def _plot(result: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, counts in result["accepted_per_position"].items():
        drafts = result[name]["all"]["num_drafts"]
        left.plot(range(1, len(counts) + 1), [c / drafts for c in counts], marker="o", label=name)
    left.set(xlabel="draft position k", ylabel="P(first k drafts accepted)", title="acceptance by position")
    left.legend()
    timing = result["timing_batch1"]
    names = ["plain", "prompt_lookup", "dflash"]
    medians = [timing[n]["tokens_per_second"] for n in names]
    spread = [[m - timing[n]["min"] for m, n in zip(medians, names)],
              [timing[n]["max"] - m for m, n in zip(medians, names)]]
    right.bar(names, medians, yerr=spread, capsize=4, color=["grey", "tab:orange", "tab:blue"])
    right.set(ylabel="tokens/s (batch 1)", title=f"{result['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _rate(timing: dict) -> str:
    return f"{timing['tokens_per_second']:.1f} ({timing['min']:.1f}-{timing['max']:.1f})"


def _markdown(result: dict, meta: dict) -> str:
    timing = result["timing_batch1"]
    rows = [f"| {name} | {result[name]['all']['mean_acceptance_length']:.3f} | "
            f"{result[name]['ordinary']['mean_acceptance_length']:.3f} | "
            f"{result[name]['table']['mean_acceptance_length']:.3f} | "
            f"{_rate(timing[name])} | {timing[name]['speedup']:.2f}x "
            f"({timing[name]['speedup_min']:.2f}-{timing[name]['speedup_max']:.2f}) |"
            for name in ("dflash", "prompt_lookup")]
    return "\n".join([
        f"# Acceptance and batch-1 speedup: {meta['name']}", "",
        f"- date {meta['date']}, commit {meta['commit']}, device {result['device']}",
        f"- command: `{meta['command']}`",
        f"- target {meta['target']}, drafter {meta['drafter']}, dtype {meta['dtype']}",
        f"- {result['num_prompts']} held-out prompts of {meta['prompt_len']} tokens, greedy, "
        f"{result['max_tokens']} new tokens, K={result['num_speculative_tokens']}; "
        f"identical to plain greedy: DFlash {result['lossless_dflash']}, prompt lookup "
        f"{result['lossless_prompt_lookup']}", "",
        "| drafter | mean acceptance length | ordinary code | table-like "
        "| tokens/s (batch 1), median (min-max) | speedup, median (min-max) |",
        "| --- | --- | --- | --- | --- | --- |", *rows,
        f"| plain | 1 | 1 | 1 | {_rate(timing['plain'])} | 1.00x |", "",
        f"Timing: {timing['rounds']} rounds of {timing['prompts']} prompts one at a time, plain, DFlash and "
        "prompt lookup back to back on each prompt, after a warm-up; a speed-up is taken within each "
        f"round. Threads: {meta['threads']}. Prompts: "
        f"{result['dflash']['ordinary']['prompts']} ordinary, "
        f"{result['dflash']['table']['prompts']} table-like.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--timing-prompts", type=int, default=8)
    parser.add_argument("--timing-rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--held-out-percent", type=float, default=5.0)
    parser.add_argument("--corpus", nargs="+", help="roots the prompts' split is taken from (default: this "
                        "Python's stdlib; on another machine pass the training machine's stdlib copy)")
    parser.add_argument("--device")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--name", default="speedup_cpu")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    target, drafter = args.target or str(demo_target_path()), args.drafter or str(demo_drafter_path())
    checkpoint = open_target_checkpoint(target)
    block_size = open_drafter_checkpoint(drafter, checkpoint.config)[0].block_size
    _, held = split_documents(load_documents(args.corpus), args.held_out_percent)
    prompts = held_out_prompts(checkpoint.tokenizer, held, args.prompts, args.prompt_len, seed=args.seed)
    result = evaluate_pair(target, drafter, prompts, num_speculative_tokens=block_size - 1,
                           max_tokens=args.max_tokens, device=args.device, dtype=args.dtype,
                           timing_prompts=args.timing_prompts, timing_rounds=args.timing_rounds,
                           tokenizer=checkpoint.tokenizer)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"name": args.name, "date": datetime.date.today().isoformat(), "commit": commit,
            "command": "python -m bench.bench_demo_speedup " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
                for k, v in vars(args).items() if v is not None),
            "target": target, "drafter": drafter, "dtype": args.dtype, "prompt_len": args.prompt_len,
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({**meta, **result}, indent=2) + "\n")
    (RESULTS / f"{args.name}.md").write_text(_markdown(result, meta))
    _plot(result, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
