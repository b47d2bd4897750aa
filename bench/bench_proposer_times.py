"""Process time of ngram, DFlash and hybrid decoding one prompt class on the demo pair, as one JSON line.

    python -m bench.bench_proposer_times CLASS [--rounds 2] [--max-tokens 64] [--seed 1]

Why: `bench.bench_proposers` judges the hybrid against its goals in one process; a change to the engine
is judged by running this from two checkouts in turn (A B A B, each `PYTHONPATH=<checkout>`), since
runs minutes apart on these cores differ by more than a small change does. Each round decodes every
prompt of the class alone (b1) and the class in one batch (b4), per method, after one warm-up; times
are `time.process_time` seconds per round. `same_as_ngram` says whether each method's batch-1 tokens
equal ngram's (all three are greedy decoding of the target, so they must).
"""

from __future__ import annotations

import argparse
import json
import time

from bench.proposer_prompts import prompt_classes
from target_service.assembly.demo import demo_drafter_path, demo_target_path
from target_service.engine.sampling_params import SamplingParams
from target_service.llm import LLM

METHODS = ("ngram", "dflash", "hybrid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt_class", choices=("code", "repeats", "edits"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    target, drafter = str(demo_target_path()), str(demo_drafter_path())
    prompts = prompt_classes(target, 4, args.seed)[args.prompt_class]
    settings = dict(device="cpu", dtype="float32", max_num_seqs=len(prompts), num_speculative_tokens=15,
                    max_model_len=512, kv_cache_memory="256MiB")
    llms = {method: LLM(target, None if method == "ngram" else drafter, speculative_method=method, **settings)
            for method in METHODS}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    times = {f"{method}/{mode}": [] for method in METHODS for mode in ("b1", "b4")}
    tokens = {}
    try:
        for llm in llms.values():
            llm.generate(prompts, params)  # warm-up
        for _ in range(args.rounds):
            for method, llm in llms.items():
                started = time.process_time()
                alone = [llm.generate([prompt], params)[0] for prompt in prompts]
                times[f"{method}/b1"].append(time.process_time() - started)
                started = time.process_time()
                llm.generate(prompts, params)
                times[f"{method}/b4"].append(time.process_time() - started)
                tokens[method] = [out.outputs[0].token_ids for out in alone]
    finally:
        for llm in llms.values():
            llm.close()
    print(json.dumps({"class": args.prompt_class, "times": times,
                      "same_as_ngram": {method: tokens[method] == tokens["ngram"] for method in METHODS}}))


if __name__ == "__main__":
    main()
