"""What the hybrid's bookkeeping costs beyond prompt lookup, with the drafter's choice taken out.

    python -m bench.hybrid_overhead [--prompts-per-class 4] [--rounds 5] [--max-tokens 128]
        [--device cuda] [--seed 1] [--out bench/results/hybrid_overhead.md]

Why: `bench.bench_proposers` finds the hybrid below ngram's tok/s on prompts the lookup serves best,
and the gap mixes two things: what its choice does (steps that run the DFlash drafter, which cost
more and may or may not pay) and what every hybrid step pays whatever it chooses (scoring the
proposals, keeping the drafter's context whole from the verify's taps, the taps themselves). Here a
third engine, `lookup-only`, is the hybrid with its choice pinned to the lookup on every row of every
step: it drafts exactly what ngram drafts (the same index, the same proposals), so its outputs and
acceptance equal ngram's and its tok/s differs by that per-step cost alone. The context it keeps is
stored as the hybrid stores it (held, then stored when the hold is full or a sequence ends).

Each round runs ngram, lookup-only and hybrid back to back on every prompt alone and on each class in
one batch, in an order that rotates by round (after one warm-up round); tok/s is the median over
rounds (min-max), and per step the host-and-device time beyond ngram's is
(seconds / steps) of lookup-only less ngram's, with steps counted by the runner's launches. On a CPU
speeds are per second of process time, on a GPU of wall time.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import time
from pathlib import Path

import torch

from bench.bench_proposers import open_engines, run_once
from bench.proposer_prompts import prompt_classes
from dflash_cli.bench.proposer_modes import pin_to_lookup
from target_service.assembly.demo import demo_drafter_path, demo_target_path
from target_service.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("ngram", "lookup-only", "hybrid")


def count_steps(llm) -> list[int]:
    """A counter of the runner's launches (steps), one list cell the caller reads and resets."""
    runner, counter = llm.assembly.runner, [0]
    launch = runner.launch

    def counted(plan):
        counter[0] += 1
        return launch(plan)
    runner.launch = counted
    return counter


def measure(classes: dict[str, list[list[int]]], *, max_tokens: int, rounds: int, device: str,
            dtype: str) -> dict:
    target, drafter = str(demo_target_path()), str(demo_drafter_path())
    clock = time.process_time if device == "cpu" else time.perf_counter
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    longest = max(len(p) for prompts in classes.values() for p in prompts)
    batch = max(len(prompts) for prompts in classes.values())
    settings = dict(num_speculative_tokens=15, batch=batch, max_model_len=longest + max_tokens + 31,
                    device=device, dtype=dtype)
    engines = open_engines(target, drafter, methods=("ngram", "hybrid"), **settings)
    engines["lookup-only"] = open_engines(target, drafter, methods=("hybrid",), **settings)["hybrid"]
    pin_to_lookup(engines["lookup-only"])
    steps = {name: count_steps(llm) for name, llm in engines.items()}
    record = {"max_tokens": max_tokens, "rounds": rounds, "clock": clock.__name__, "cells": {}}
    try:
        for cls, prompts in classes.items():
            for mode, groups in (("batch1", [[p] for p in prompts]), ("batch", [prompts])):
                runs = {name: [] for name in ENGINES}
                for round_ in range(rounds + 1):  # round 0 warms up
                    turn = ENGINES[round_ % 3:] + ENGINES[:round_ % 3]
                    for name in turn:
                        seconds = tokens = 0.0
                        steps[name][0] = 0
                        outs = []
                        for group in groups:
                            run = run_once(engines[name], group, params, clock, None)
                            seconds += run["seconds"]
                            tokens += sum(len(t) for t in run["tokens"])
                            outs.append(run["tokens"])
                        runs[name].append({"seconds": seconds, "tokens": tokens, "steps": steps[name][0],
                                           "outputs": outs})
                record["cells"][f"{cls}/{mode}"] = summarize(runs)
    finally:
        for llm in engines.values():
            llm.close()
    return record


def summarize(runs: dict[str, list[dict]]) -> dict:
    timed = {name: rounds[1:] for name, rounds in runs.items()}
    cell = {}
    for name, rounds in timed.items():
        speeds = [r["tokens"] / r["seconds"] for r in rounds]
        cell[name] = {"tokens_per_s": {"median": statistics.median(speeds), "min": min(speeds),
                                       "max": max(speeds)},
                      "us_per_step": statistics.median(1e6 * r["seconds"] / r["steps"] for r in rounds),
                      "steps": rounds[0]["steps"]}
    ngram = cell["ngram"]
    for name in ("lookup-only", "hybrid"):
        cell[name]["over_ngram"] = cell[name]["tokens_per_s"]["median"] / ngram["tokens_per_s"]["median"]
    cell["lookup-only"]["extra_us_per_step"] = cell["lookup-only"]["us_per_step"] - ngram["us_per_step"]
    cell["lookup_only_equals_ngram"] = all(a["outputs"] == b["outputs"]
                                           for a, b in zip(runs["lookup-only"], runs["ngram"]))
    return cell


def report(record: dict) -> str:
    lines = [f"# {__doc__.splitlines()[0]}", "",
             f"- command: `{record['command']}`", f"- device: {record['device']}",
             f"- commit {record['commit']}, {record['date']}; torch {record['torch']}, {record['dtype']}",
             f"- greedy, ignore_eos, K 15, {record['max_tokens']} new tokens, {record['rounds']} timed "
             f"rounds after a warm-up; tok/s of {record['clock']}: median (min-max)", "",
             "| class / batch | ngram tok/s | lookup-only tok/s | hybrid tok/s | lookup-only / ngram | "
             "hybrid / ngram | µs a step: ngram, lookup-only (extra) | lookup-only's outputs = ngram's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def rate(row):
        s = row["tokens_per_s"]
        return f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"
    for name, cell in record["cells"].items():
        ngram, pinned, hybrid = cell["ngram"], cell["lookup-only"], cell["hybrid"]
        lines.append(f"| {name} | {rate(ngram)} | {rate(pinned)} | {rate(hybrid)} | "
                     f"{pinned['over_ngram']:.3f} | {hybrid['over_ngram']:.3f} | "
                     f"{ngram['us_per_step']:.0f}, {pinned['us_per_step']:.0f} "
                     f"({pinned['extra_us_per_step']:+.0f}) | {cell['lookup_only_equals_ngram']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts-per-class", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "hybrid_overhead.md"))
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "float32" if device == "cpu" else "bfloat16"
    if device == "cpu":
        torch.set_num_threads(2)
    classes = prompt_classes(str(demo_target_path()), args.prompts_per_class, args.seed)
    record = measure(classes, max_tokens=args.max_tokens, rounds=args.rounds, device=device, dtype=dtype)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
    record.update(command=f"python -m bench.hybrid_overhead {flags}", commit=commit.stdout.strip(),
                  device=torch.cuda.get_device_name() if device == "cuda" else "CPU, 2 threads",
                  date=datetime.date.today().isoformat(), torch=torch.__version__, dtype=dtype)
    text = report(record)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
