"""The target's GEMMs at the step's row counts, in the two weight layouts torch can hand cuBLAS.

    python -m bench.bench_small_gemm [--geometry qwen3-8b] [--rows 1 8 16 32 64 128 512] [--reps 200]

Why: a B 1 DFlash step verifies 16 rows, and its time is the weights' bytes read once (the 8B target
16.4 GB): whatever a GEMM reads below the copy bandwidth is the step's to win back (issue 33, item 2).
The engine computes `F.linear(x, W)` with W [N, K] row-major (cuBLAS sees a transposed operand);
`x @ Wt` with Wt [K, N] contiguous is the same product from the other layout, for which cuBLAS's
heuristics may pick another kernel (split-K or not, tile shape). Each GEMM of one decoder layer
(q/k/v, o, gate/up, down) and the lm_head is timed at each row count, from a CUDA graph of `--reps`
back-to-back calls (launch gaps as in the step's graphs) that cycle through copies of the weight
filling 400 MB (one weight read over and over would come from L2: a 33 MB o projection read at
3.7 TB/s on an H100, past its HBM's 3.35), and reported as achieved weight bandwidth against a
device-to-device copy's on the same GPU. The two layouts' outputs are compared as well. At
`--skinny-rows` the Triton candidate `kernels.skinny_gemm` is swept over its `CANDIDATES` launch
shapes and its fastest reported beside cuBLAS (with its largest difference from F.linear), and the
launch shape `rule_tiles` picks (what `kernels.linear` runs) timed beside both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from dflash_cli.bench.random_pair import GEOMETRIES
from foundation.checkpoint_config import TargetConfig, load_target_config
from kernels.skinny_gemm import CANDIDATES, SkinnyTiles, rule_tiles, skinny_gemm

L2_SAFE_BYTES = 400 << 20  # the weights one timing cycles through: several times any Hopper's L2


def layer_shapes(config: TargetConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of each weight of one target layer, and of the lm_head."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (config.vocab_size, hidden)}


def graph_time(call, reps: int) -> float:
    """Seconds per call: `reps` calls captured in one CUDA graph, replayed (median of 5 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / reps)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, read + write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / graph_time(lambda: dst.copy_(src), 10)


def _cycling(op, x: torch.Tensor, weights: list[torch.Tensor]):
    """A call of op(x, w) that takes the next of `weights` each time (so each captured call has its own)."""
    turn = iter(range(1 << 62))
    return lambda: op(x, weights[next(turn) % len(weights)])


def best_skinny(x: torch.Tensor, weights: list[torch.Tensor], reps: int) -> tuple[float, SkinnyTiles, float]:
    """(seconds per call, tiles) of the fastest `skinny_gemm` candidate on this shape, and its largest
    difference from F.linear's output."""
    timed = []
    for tiles in CANDIDATES:
        call = _cycling(lambda x, w, tiles=tiles: skinny_gemm(x, w, tiles), x, weights)
        try:
            timed.append((graph_time(call, reps), tiles))
        except (RuntimeError, triton.runtime.errors.OutOfResources) as exc:  # shared memory, registers
            print(f"  skipped {tuple(tiles)}: {type(exc).__name__}", flush=True)
    seconds, tiles = min(timed)
    diff = (skinny_gemm(x, weights[0], tiles).float() - F.linear(x, weights[0]).float()).abs().max().item()
    return seconds, tiles, diff


def measure(shapes: dict[str, tuple[int, int]], rows: list[int], reps: int, dtype: torch.dtype,
            skinny_rows: list[int], skinny_reps: int) -> list[dict]:
    results = []
    for name, (n, k) in shapes.items():
        # Enough copies of the weight that a pass over them cannot live in L2 (50-60 MB on an H100 / H200):
        # in a step every layer reads weights of its own, so no call may find the last one's in cache.
        nbytes = n * k * dtype.itemsize
        copies = max(1, -(-L2_SAFE_BYTES // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
        weights_t = [weight.t().contiguous() for weight in weights]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            linear = graph_time(_cycling(F.linear, x, weights), reps)
            matmul = graph_time(_cycling(torch.matmul, x, weights_t), reps)
            diff = (F.linear(x, weights[0]).float() - (x @ weights_t[0]).float()).abs().max().item()
            results.append({"gemm": name, "n": n, "k": k, "rows": m, "weight_mb": nbytes / 1e6,
                            "linear_us": linear * 1e6, "matmul_t_us": matmul * 1e6,
                            "linear_tbs": nbytes / linear / 1e12, "matmul_t_tbs": nbytes / matmul / 1e12,
                            "max_abs_diff": diff})
            if m in skinny_rows:
                skinny, tiles, skinny_diff = best_skinny(x, weights, skinny_reps)
                rule = graph_time(_cycling(skinny_gemm, x, weights), reps)  # rule_tiles' choice
                results[-1].update(skinny_us=skinny * 1e6, skinny_tbs=nbytes / skinny / 1e12,
                                   skinny_tiles=tiles._asdict(), skinny_max_abs_diff=skinny_diff,
                                   rule_us=rule * 1e6, rule_tiles=rule_tiles(n, k, x.device)._asdict())
            swept = results[-1]
            skinny_line = (f", skinny {swept['skinny_us']:8.1f} us {tuple(swept['skinny_tiles'].values())}"
                           f", rule {swept['rule_us']:8.1f} us" if "skinny_us" in swept else "")
            print(f"{name:8s} M {m:4d}: F.linear {linear * 1e6:8.1f} us, x @ Wt {matmul * 1e6:8.1f} us, "
                  f"max|diff| {diff:.2e}{skinny_line}", flush=True)
        del weights, weights_t
    return results


def report(results: list[dict], copy_tbs: float, header: list[str]) -> str:
    lines = [*header, "", f"Copy bandwidth (read + write): {copy_tbs:.2f} TB/s.", "",
             "| GEMM (N x K) | rows | F.linear us (TB/s, % copy) | x @ Wt us (TB/s, % copy) "
             "| Wt / linear time | skinny_gemm best us (TB/s) [tiles] | skinny / linear time "
             "| rule_tiles' us [split] | rule / linear time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        skinny = skinny_ratio = rule = rule_ratio = "-"
        if "skinny_us" in r:
            tiles = "n {block_n} k {block_k} split {split_k} stages {num_stages} swap {swap_ab}".format(
                **r["skinny_tiles"])
            skinny = f"{r['skinny_us']:.1f} ({r['skinny_tbs']:.2f}) [{tiles}]"
            skinny_ratio = f"{r['skinny_us'] / r['linear_us']:.3f}"
            rule = f"{r['rule_us']:.1f} [{r['rule_tiles']['split_k']}]"
            rule_ratio = f"{r['rule_us'] / r['linear_us']:.3f}"
        lines.append(
            f"| {r['gemm']} ({r['n']} x {r['k']}) | {r['rows']} "
            f"| {r['linear_us']:.1f} ({r['linear_tbs']:.2f}, {100 * r['linear_tbs'] / copy_tbs:.0f}%) "
            f"| {r['matmul_t_us']:.1f} ({r['matmul_t_tbs']:.2f}, {100 * r['matmul_t_tbs'] / copy_tbs:.0f}%) "
            f"| {r['matmul_t_us'] / r['linear_us']:.3f} | {skinny} | {skinny_ratio} | {rule} "
            f"| {rule_ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", default="qwen3-8b", choices=sorted(GEOMETRIES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--skinny-rows", type=int, nargs="*", default=[1, 16],
                        help="row counts at which skinny_gemm's candidates are swept (none: no sweep)")
    parser.add_argument("--skinny-reps", type=int, default=50, help="calls per graph in the sweep")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="small_gemm")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_small_gemm needs a CUDA device")
    shapes = layer_shapes(load_target_config(GEOMETRIES[args.geometry][0]))
    copy_tbs = copy_bandwidth() / 1e12
    results = measure(shapes, args.rows, args.reps, torch.bfloat16, args.skinny_rows, args.skinny_reps)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    header = [f"# The target's GEMMs at small row counts: F.linear(x, W) against x @ W.t() contiguous "
              f"({args.geometry})",
              "", f"- command: `python -m bench.bench_small_gemm {' '.join(argv or sys.argv[1:])}`",
              f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}; bf16",
              f"- commit {git.stdout.strip()}, "
              f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
              f"- each time: a CUDA graph of {args.reps} back-to-back calls, median of 5 replays"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(report(results, copy_tbs, header))
    (out / f"{args.name}.json").write_text(json.dumps({"copy_tbs": copy_tbs, "results": results}, indent=1))


if __name__ == "__main__":
    main()
