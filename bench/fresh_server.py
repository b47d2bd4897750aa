"""A fresh server as its first users meet it: `dflash serve`'s app over one replica (`bench.serve_in_process`)
started in this process, timed to ready, then `dflash bench serve` from its very first request (no
warm-up) through the passes of issue 31's table: new prompts of lengths drawn from a range, the same
prompts again (prefix hits) twice, then new prompts of the same lengths; per pass p50/p99 TTFT and
inter-token latency, the longest gap, gaps over 250 ms, and the kernels compiled while it ran.

    python -m bench.fresh_server --mode plain|dflash --out DIR [--concurrency 8] [--num-prompts 48]
        [--input-len 16-3000] [--output-len 128] [--kv-cache-dtype auto|fp8] [--max-num-seqs 32]
        [--geometry qwen3-8b|tiny] [--device cuda|cpu] [--kv-cache-memory 24GiB]
        [--passes new repeat repeat new] [--input-lens-file FILE] [--max-prefill-tokens-with-decodes N]

`--input-lens-file` with mostly short prompts and some 3,000-token ones, at several
`--max-prefill-tokens-with-decodes`, measures what a long prompt's prefill costs the streams that
decode beside it (their gaps) and what capping it costs its own time to first token.

Run it in a process of its own with TRITON_CACHE_DIR pointing at an empty directory for the cold
start (`bench/fresh_server_h200.sh` does). Writes DIR/<name>.json, .md and the gap plot (those of
`dflash bench serve`), and DIR/<name>_startup.json (time to ready, compiles at start-up, and each
compile after ready with its time since ready and its cause, from this process's compile watch:
it also counts an engine older than the server's compile metric, which a before-and-after run
puts under the same client) and each collection of the garbage collector's oldest generation after
ready, with its pause (`foundation.gc_pauses`; DFLASH_GC_FREEZE=0 runs the server without freezing its
start-up heap).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.bench_serve_modes import write_word_tokenizer
from bench.serve_in_process import replica_server
from dflash_cli.bench import serve_load
from dflash_cli.bench.random_pair import write_random_pair
from foundation.checkpoint_config import load_target_config
from foundation.gc_pauses import GcPauses
from kernels.compile_watch import WATCH

PASSES = ["new", "repeat", "repeat", "new"]
COMPILES = "dflash:kernel_compilations_total"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["plain", "dflash"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", help="results stem (default: fresh_server_<mode>)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", default="16-3000")
    parser.add_argument("--input-lens-file", help="prompt lengths to sample (one per line), instead of "
                                                  "--input-len")
    parser.add_argument("--output-len", default="128")
    parser.add_argument("--passes", nargs="+", default=PASSES, choices=["new", "repeat"])
    parser.add_argument("--max-prefill-tokens-with-decodes", type=int,
                        help="the server's cap on prompt tokens a step prefills beside decodes")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-memory", default="24GiB")
    parser.add_argument("--geometry", default="qwen3-8b", choices=["qwen3-8b", "tiny"])
    parser.add_argument("--checkpoints", default="/tmp/dflash-e2e-pair")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    name = args.name or f"fresh_server_{args.mode}"
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    target, drafter = write_random_pair(Path(args.checkpoints), args.geometry, dtype=dtype)
    write_word_tokenizer(target, load_target_config(target).vocab_size)
    from target_service.serving.serve_args import ServeArgs

    serve_args = ServeArgs(target=str(target), drafter=str(drafter) if args.mode == "dflash" else "none",
                           device=args.device, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype,
                           max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                           kv_cache_memory=args.kv_cache_memory, admin_port=None,
                           max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes)
    lengths = (["--input-lens-file", args.input_lens_file] if args.input_lens_file
               else ["--input-len", args.input_len])
    WATCH.install()  # the engine installs it too; an engine from before it did is watched all the same
    gc_pauses = GcPauses.shared()  # this process's collections: the server's and the client's heap
    started = time.perf_counter()
    with replica_server(serve_args) as (url, _replica):
        ready_s = time.perf_counter() - started
        WATCH.mark_ready()  # the server answers: what builds from here is on the serving path
        ready_at = time.monotonic()  # compiles after it are timed from here
        gc_ready_at = gc_pauses.clock()
        startup = {"mode": args.mode, "ready_s": round(ready_s, 2),
                   "max_prefill_tokens_with_decodes": args.max_prefill_tokens_with_decodes,
                   "compiled_at_startup": len(WATCH.compilations), "command": " ".join(sys.argv)}
        print(json.dumps(startup), flush=True)
        code = serve_load.main([
            "--url", f"{url}/v1", "--cold", "--passes", *args.passes, "--concurrency",
            *map(str, args.concurrency), "--num-prompts", str(args.num_prompts), "--prompts", "random",
            "--tokenizer-dir", str(target), *lengths, "--output-len", args.output_len,
            "--metrics-counter", COMPILES, "--metrics-scrapes", "1", "--out", args.out, "--name", name,
            "--no-progress"])
        startup["oldest_collections_while_serving"] = [  # generation 2: a walk of the whole heap
            {"at_s": round(end - gc_ready_at, 2), "ms": round(1e3 * length, 1)}
            for end, length, generation in gc_pauses.recent() if end > gc_ready_at and generation == 2]
        startup["compiled_while_serving"] = [
            {"at_s": round(item.at - ready_at, 2), "why": WATCH.explain(item)} for item in WATCH.after_ready]
    (Path(args.out) / f"{name}_startup.json").write_text(json.dumps(startup, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
