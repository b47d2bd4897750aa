"""Two drafters for the demo target, evaluated on the SAME held-out prompts (several prompt seeds).

    python -m bench.bench_compare_demo_drafters DRAFTER_A DRAFTER_B [--seeds 0 1] [--out FILE.json]

Acceptance (K = 15, greedy, 128 new tokens, float32) through the engine, prompt lookup beside it,
and the batch-1 speed against plain decoding, per prompt set.
"""

from __future__ import annotations

import argparse
import json

import torch

from target_service.assembly.demo import demo_target_path
from target_service.runner.checkpoint import open_target_checkpoint
from training.corpus import held_out_prompts, load_documents, split_documents
from training.evaluate import evaluate_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = str(demo_target_path())
    tokenizer = open_target_checkpoint(target).tokenizer
    _, held_out = split_documents(load_documents(), 5.0)
    results = {}
    for seed in args.seeds:
        prompts = held_out_prompts(tokenizer, held_out, 32, 64, seed=seed)
        for drafter in args.drafters:
            r = evaluate_pair(target, drafter, prompts, tokenizer=tokenizer, num_speculative_tokens=15,
                              max_tokens=128, device="cpu", dtype="float32", timing_prompts=4)
            results[f"seed {seed}: {drafter}"] = {
                "dflash": r["dflash"]["all"]["mean_acceptance_length"],
                "dflash_ordinary": r["dflash"]["ordinary"]["mean_acceptance_length"],
                "prompt_lookup": r["prompt_lookup"]["all"]["mean_acceptance_length"],
                "lossless": r.get("lossless_dflash"), "speedup": r["timing_batch1"]["dflash"]["speedup"],
            }
            print(f"seed {seed}: {drafter}: {results[f'seed {seed}: {drafter}']}", flush=True)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
