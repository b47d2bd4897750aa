"""What logprobs cost: output tokens/s of the same greedy batch without logprobs and with them (0 and
20 most likely), and prompt tokens/s of lm-eval-style scoring (a prompt, one generated token) without
and with its prompt's logprobs; plain decoding and DFlash, through the offline engine.

    python -m bench.bench_logprobs_cost [--pair demo|qwen3-8b|tiny] [--device cuda] [--batch 8]
        [--prompt-len 256] [--max-tokens 64] [--score-len 1024] [--rounds 3] [--name logprobs_cost_cpu]

Each round runs every mode back to back (after one warm-up round); a mode's speed is the median over
rounds and its cost the median of its per-round ratio to the round's run without logprobs (a shared
host swings between runs, a ratio taken within one round less). On a GPU speeds are per second of wall
time; on a CPU per second of this process's CPU time, which other processes on the host disturb far
less than they do the wall clock. `--pair demo` is the shipped pair (a
trained drafter, so drafts are accepted); qwen3-8b and tiny are random pairs of that geometry
(`dflash_cli.bench.random_pair`: acceptance near zero, but every step verifies K + 1 rows, whose
logprobs are what a verify step gathers). Writes bench/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from dflash_cli.bench.random_pair import device_name, write_random_pair
from target_service.assembly.demo import demo_drafter_path, demo_target_path
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

RESULTS = Path(__file__).resolve().parent / "results"


def modes(args) -> dict[str, tuple[int, int, SamplingParams]]:
    """name -> (prompt length, tokens counted per request, params); scoring counts prompt tokens."""
    generate = dict(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    score = dict(max_tokens=1, temperature=0)
    return {
        "no logprobs": (args.prompt_len, args.max_tokens, SamplingParams(**generate)),
        "logprobs 0": (args.prompt_len, args.max_tokens, SamplingParams(**generate, logprobs=0)),
        "logprobs 20": (args.prompt_len, args.max_tokens, SamplingParams(**generate, logprobs=20)),
        "score, no logprobs": (args.score_len, args.score_len, SamplingParams(**score)),
        "score, prompt logprobs 1": (args.score_len, args.score_len,
                                     SamplingParams(**score, logprobs=1, prompt_logprobs=1)),
    }


def pair(args) -> tuple[str, str]:
    if args.pair == "demo":
        return str(demo_target_path()), str(demo_drafter_path())
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    target, drafter = write_random_pair(Path(args.checkpoints), args.pair, dtype=dtype)
    return str(target), str(drafter)


def timed(llm: LLM, prompts, params: SamplingParams, counted: int, clock) -> float:
    """Tokens per second of `clock` of one batch (`counted` tokens per request)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = clock()
    llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return counted * len(prompts) / (clock() - started)


def measure(llm: LLM, args, vocab: int, clock) -> dict:
    table = modes(args)
    generator = torch.Generator().manual_seed(0)
    prompts = {length: [torch.randint(3, vocab, (length,), generator=generator).tolist()
                        for _ in range(args.batch)] for length in {args.prompt_len, args.score_len}}
    speeds = {name: [] for name in table}
    for round_ in range(args.rounds + 1):  # the first round warms up (compiles, allocator)
        for name, (length, counted, params) in table.items():
            speed = timed(llm, prompts[length], params, counted, clock)
            if round_:
                speeds[name].append(speed)
    out = {}
    for name, values in speeds.items():
        baseline = speeds["score, no logprobs" if name.startswith("score") else "no logprobs"]
        out[name] = {"tokens_per_s": statistics.median(values), "min": min(values), "max": max(values),
                     "vs_without": statistics.median(v / b for v, b in zip(values, baseline))}
    return out


def engine_settings(args, device: torch.device) -> dict:
    longest = max(args.prompt_len + args.max_tokens, args.score_len + 1)
    settings = dict(device=str(device), dtype=args.dtype, max_num_seqs=args.batch, max_model_len=longest + 64)
    if device.type == "cpu":
        return dict(settings, kv_cache_memory="256MiB")
    # a pool for this batch only: 90% of the GPU held by the first engine would leave the second none
    return dict(settings, cuda_graph_sizes=[args.batch], kv_cache_memory="8GiB")


def report(record: dict, args) -> str:
    lines = [f"# Logprobs cost: {args.pair} pair on {record['device']}", "",
             f"- command: `{record['command']}`", f"- commit: {record['commit']}, {record['date']}",
             f"- batch {args.batch}, prompts of {args.prompt_len} tokens generating {args.max_tokens}; "
             f"scoring: prompts of {args.score_len} tokens, one generated",
             f"- tokens per second of {record['clock']} (process_time: this process's CPU time)", "",
             "| method | mode | tokens/s (median, min-max) | vs without logprobs |",
             "| --- | --- | --- | --- |"]
    for method, rows in record["results"].items():
        acceptance = rows["acceptance_length"]
        for name, row in rows.items():
            if name != "acceptance_length":
                speed = f"{row['tokens_per_s']:.0f} ({row['min']:.0f}-{row['max']:.0f})"
                ratio = row["vs_without"]
                lines.append(f"| {method} (acceptance {acceptance:.2f}) | {name} | {speed} | {ratio:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="demo", choices=["demo", "qwen3-8b", "tiny"])
    parser.add_argument("--checkpoints", default="/tmp/dflash-e2e-pair")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--score-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    parser.add_argument("--name", default="logprobs_cost_cpu")
    args = parser.parse_args()
    target, drafter = pair(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    results = {}
    speculative = dict(drafter=drafter, num_speculative_tokens=args.num_speculative_tokens)
    for method, drafting in (("plain", dict(drafter="none")), ("dflash", speculative)):
        llm = LLM(target, **drafting, **engine_settings(args, device))
        results[method] = measure(llm, args, llm.engine.vocab_size, clock)
        results[method]["acceptance_length"] = llm.stats.mean_acceptance_length
        llm.close()
        del llm  # the next engine loads its weights where this one's were
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
    record = {"device": device_name(device), "clock": clock.__name__,
              "command": f"python -m bench.bench_logprobs_cost {flags}", "commit": commit.stdout.strip(),
              "date": datetime.date.today().isoformat(), "results": results}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    text = report(record, args)
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
