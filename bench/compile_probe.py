"""Which Triton kernels compile after start-up, and why: the in-process engine (Qwen3-8B shapes, a
few target layers: the same kernels in seconds) started, then driven by a randomised workload
(`dflash_cli.bench.varied_workload`) while `kernels.compile_watch` records every specialisation
built. For each one built after ready, it names the kernel and the argument classes that differ
from the closest specialisation built before (the cause), and the step it stalled.

    python -m bench.compile_probe --out DIR [--configs plain:auto dflash:auto dflash:fp8 dflash:auto:0]
        [--requests 48] [--max-prompt 3000] [--max-tokens 128] [--target-layers 6] [--seed 0]

A config is method:cache dtype[:prefill tokens beside decodes] (0: no cap, the step's whole budget;
default: the engine's). GPU only (under the interpreter nothing compiles). Writes
DIR/compile_probe.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from dflash_cli.bench.random_pair import write_random_pair
from dflash_cli.bench.varied_workload import drive, varied_requests
from kernels.compile_watch import WATCH
from target_service.assembly.engine_args import DEFAULT_PREFILL_WITH_DECODES
from target_service.llm import LLM


def probe(config: str, pair: tuple[Path, Path], args: argparse.Namespace) -> dict:
    method, cache_dtype, *cap = config.split(":")
    cap = int(cap[0]) if cap else DEFAULT_PREFILL_WITH_DECODES
    target, drafter = pair
    WATCH.install()
    before = len(WATCH.compilations)
    started = time.perf_counter()
    llm = LLM(str(target), str(drafter) if method == "dflash" else "none", device=args.device,
              dtype="bfloat16" if args.device == "cuda" else "float32", kv_cache_dtype=cache_dtype,
              max_model_len=args.max_prompt + args.max_tokens + 32, max_num_seqs=args.max_num_seqs,
              kv_cache_memory=args.kv_cache_memory, seed=args.seed,
              max_prefill_tokens_with_decodes=cap or None)
    ready_s = time.perf_counter() - started
    startup = WATCH.compilations[before:]
    WATCH.mark_ready()
    try:
        rng = random.Random(args.seed)
        requests = varied_requests(rng, args.requests, vocab_size=llm.engine.vocab_size,
                                   max_prompt=args.max_prompt, max_tokens=args.max_tokens, min_prompt=16)
        ready_at = time.monotonic()
        result = drive(llm.engine, requests, rng)
        serving = [built for built in WATCH.compilations[before:] if built.after_ready]
        steps = sorted(result.step_seconds)
        return {
            "config": config, "ready_s": round(ready_s, 2), "compiled_at_startup": len(startup),
            "compiled_after_ready": len(serving),
            "after_ready": [{"at_s": round(built.at - ready_at, 2), "why": WATCH.explain(built),
                             "arguments": built.arguments} for built in serving],
            "steps": len(steps), "step_p50_ms": round(1e3 * steps[len(steps) // 2], 2),
            "step_p99_ms": round(1e3 * steps[int(len(steps) * 0.99)], 2),
            "longest_step_ms": round(1e3 * result.longest_step, 1),
            "longest_step_with_decodes_ms": round(1e3 * max(result.decode_step_seconds, default=0), 1),
            "steps_with_decodes_over_100ms": sum(1 for s in result.decode_step_seconds if s > 0.1),
            "workload_s": round(sum(result.step_seconds), 2),
            "finished": result.finished, "aborted": result.aborted,
        }
    finally:
        WATCH.mark_starting()
        llm.close()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", nargs="+", default=["plain:auto", "dflash:auto", "dflash:fp8"])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-prompt", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--target-layers", type=int, default=6)
    parser.add_argument("--checkpoints", default="/tmp/dflash-probe-pair")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--geometry", default="qwen3-8b", choices=["qwen3-8b", "tiny"])
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the plumbing (nothing compiles)")
    parser.add_argument("--kv-cache-memory", default="24GiB")
    args = parser.parse_args(argv)
    pair = write_random_pair(Path(args.checkpoints), args.geometry, dtype="bfloat16",
                             target_layers=args.target_layers if args.geometry != "tiny" else None)
    results = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for config in args.configs:
        results.append(probe(config, pair, args))
        print(json.dumps({key: value for key, value in results[-1].items() if key != "after_ready"}),
              flush=True)
        for built in results[-1]["after_ready"]:
            print(f"  +{built['at_s']:.1f}s {built['why']}", flush=True)
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        command = "python -m bench.compile_probe " + " ".join(argv or sys.argv[1:])
        (out / "compile_probe.json").write_text(
            json.dumps({"device": device, "command": command, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
