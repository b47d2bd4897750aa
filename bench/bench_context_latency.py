"""Where the context kernel's time goes at B 1, NKV 4, D 128, Q 16, group 4 (64 rows), bf16.

    python -m bench.bench_context_latency --out DIR [--commit HASH] [--budget-s 80]
        [--parts sweep breakdown tiles]

At ctx 8192 one call (split kernel + merge) took about 17.4 us under CUDA graphs on an H200, while
its 16.8 MB of K/V would take about 4 us at copy bandwidth, and forcing 16..64 splits does not move
it (bench/results/context_attention_notes.md). This bench separates the fixed cost from the
per-byte cost and the two kernels from each other: (1) the full call under CUDA graphs for ctx
0..32768 x forced split counts (ctx 0 gives the fixed cost; a forced count of 1 is the single-pass
kernel, no merge); (2) per-kernel device time of the split kernel and of the merge (torch.profiler,
eager, as bench/bench_latency_ablation.py's breakdowns) at the default split count, with PDL on and off,
next to the graph time of the same call; (3) the split path's launch configs (merge tiles and
chunk, `CONFIGS`) at `TILE_CONTEXTS`, for B 1 and a few other split batches (`TILE_CASES`). Timing and
inputs are bench/bench_context_attention.py's (graphs over rotated input sets, median of replays). Writes
DIR/context_latency.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.runtime.errors import OutOfResources

import kernels
from bench import bench_context_attention as cab
from bench import bench_latency_ablation as la
from kernels import context_attention as ca
from kernels import pdl, split_kv

log = logging.getLogger("bench.bench_context_latency")
NKV, DTYPE = 4, "bf16"
ROWS_PAD = max(16, triton.next_power_of_2(cab.NUM_Q * cab.GROUP))
CONTEXTS = (0, 128, 1024, 4096, 8192, 32768)
SPLITS = (None, 1, 4, 8, 16, 32, 64)  # None: the public path's own plan (>= 128 keys per split)
BREAKDOWN_CONTEXTS = (8192, 32768)
# split-path configs: the split kernel's tiles were all slower than 64 / 4 / 3 (a94d6fb); here the merge's
# tile and chunk (splits folded per step); 16 x 32 x 32 was the fastest (context_latency_merge.md, 2a2f7cb)
CONFIGS = [ca.LaunchConfig(64, 4, 3),
           *(ca.LaunchConfig(64, 4, 3, merge_rows=r, merge_cols=c, merge_chunk=k)
             for r, c, k in ((16, 16, 32), (16, 64, 32), (32, 32, 32)))]
TILE_CASES = [(1, 4), (1, 8), (4, 8), (16, 4)]  # (B, NKV) on the split path
TILE_CONTEXTS = (8192,)


def context_sets(ctx, device, gen):
    """cab.make_sets at B 1, NKV 4, bf16; ctx 0 keeps one page per set and ctx_lens 0."""
    if ctx == 0:  # make_sets sizes its rotation by the K/V bytes, so it needs ctx > 0
        zero = torch.zeros(1, dtype=torch.int32)
        sets, _ = cab.make_sets(1, cab.TPB, NKV, DTYPE, device, gen, ctx_lens=zero)
        return sets, 0
    return cab.make_sets(1, ctx, NKV, DTYPE, device, gen)


def split_sweep(device, gen, copy_bw, deadline) -> list[dict]:
    """(1) us per full call under graphs, ctx x forced split count."""
    rows = []
    for ctx in CONTEXTS:
        sets, kv_bytes = context_sets(ctx, device, gen)
        for splits in SPLITS:
            row = {"ctx": ctx, "splits": splits, "kv_bytes": kv_bytes, "floor_us": kv_bytes / copy_bw * 1e6}
            if deadline.passed():
                rows.append(dict(row, skipped="time budget"))
                continue
            rows.append(dict(row, us=cab.time_ours(sets, DTYPE, num_splits=splits)))
            log.info("%s", rows[-1])
        del sets
        torch.cuda.empty_cache()
    return rows


def kernel_breakdown(device, gen, deadline) -> list[dict]:
    """(2) device us of each kernel (profiler, eager) and the graph us of the same default call."""
    rows = []
    for ctx in BREAKDOWN_CONTEXTS:
        if deadline.passed():
            break
        sets, kv_bytes = context_sets(ctx, device, gen)
        outs = [torch.empty_like(s["q"]) for s in sets]
        calls = [functools.partial(kernels.paged_context_attention, **s, out=o) for s, o in zip(sets, outs)]
        for label, enabled in (("PDL as shipped", pdl.ENABLED), ("PDL off", False)):
            with mock.patch.object(pdl, "ENABLED", enabled):
                rows.append({"ctx": ctx, "kv_bytes": kv_bytes, "pdl": label, "uses_pdl": pdl.use_pdl(device),
                             "splits": split_kv.plan_max_splits(NKV, device),
                             "graph_us": cab.time_ours(sets, DTYPE), "kernels_us": la.device_times(calls)})
            log.info("%s", rows[-1])
        del sets, outs, calls
        torch.cuda.empty_cache()
    return rows


def tile_sweep(device, gen, deadline) -> list[dict]:
    """(3) the split path with explicit launch configs (cab._configured_launch).

    B 1 with NKV 4 first (this bench's case), then other split batches, for a rule that holds there too.
    """
    rows = []
    for (batch, nkv), ctx in ((case, ctx) for case in TILE_CASES for ctx in TILE_CONTEXTS):
        sets, kv_bytes = cab.make_sets(batch, ctx, nkv, DTYPE, device, gen)
        max_splits = split_kv.plan_max_splits(batch * nkv, device)
        min_tokens = split_kv.min_tokens_per_split(ROWS_PAD)
        default = ca.default_config(ROWS_PAD, torch.bfloat16, device)
        for config in CONFIGS:
            row = {"batch": batch, "nkv": nkv, "ctx": ctx, "splits": max_splits,
                   "config": dataclasses.asdict(config),
                   "default": config == default, "kv_bytes": kv_bytes}
            if deadline.passed():
                rows.append(dict(row, skipped="time budget"))
                continue
            launches = [cab._configured_launch(s, DTYPE, max_splits, min_tokens, config) for s in sets]
            try:
                rows.append(dict(row, us=cab.time_graph(launches)))
            except OutOfResources as err:  # raised at the first (uncaptured) launch
                rows.append(dict(row, skipped=str(err).splitlines()[0]))
            log.info("%s", rows[-1])
        del sets
        torch.cuda.empty_cache()
    return rows


def kernel_us(times: dict, name: str) -> float | None:
    return next((us for key, us in times.items() if name in key), None)


def markdown(result) -> str:
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)
    lines = [f"# Context kernel latency, B 1, NKV {NKV}, D {cab.HEAD_DIM}, Q {cab.NUM_Q}, group {cab.GROUP}, "
             f"{DTYPE} ({result['device']})", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}, "
             f"triton {result['triton']}, PDL used: {result['pdl_available']}. "
             f"Command: `{result['command']}`.", "",
             f"Copy bandwidth measured here (read + write): {result['copy_bw'] / 1e9:.0f} GB/s; floor = K/V "
             "bytes / that. Times: us per call under CUDA graphs, median of replays, inputs rotated over "
             f"{cab.ROTATE_BYTES >> 20} MiB (at most {cab.MAX_SETS} sets, so short contexts stay in L2).", "",
             "## 1. Full call (split kernel + merge) by forced split count", "",
             "`default` is the public plan (grid splits "
             f"{result['default_splits']}, each split >= {split_kv.min_tokens_per_split(ROWS_PAD)} keys); "
             "a forced count splits every context that many ways (1 = the single-pass kernel, no merge).", "",
             "| ctx | K/V MB | floor us | " + " | ".join(str(s or "default") for s in SPLITS) + " |",
             "|" + "---|" * (3 + len(SPLITS))]
    for ctx in CONTEXTS:
        cells = {r["splits"]: r for r in result["sweep"] if r["ctx"] == ctx}
        if cells:
            first = next(iter(cells.values()))
            lines.append(f"| {ctx} | {first['kv_bytes'] / 1e6:.1f} | {first['floor_us']:.1f} | "
                         + " | ".join(fmt(cells.get(s, {}).get("us")) for s in SPLITS) + " |")
    lines += ["", "## 2. Split kernel vs merge at the default split count (device us, profiler, eager)", "",
              "With PDL the merge starts early and waits for the split kernel, so its device time includes "
              "some of the split kernel's; the PDL-off rows separate them.", "",
              "| ctx | PDL (used) | splits | graph us (full call) | split kernel us | merge us "
              "| graph - (split + merge) |",
              "|---|---|---|---|---|---|---|"]
    for r in result["breakdown"]:
        split = kernel_us(r["kernels_us"], "_context_attention_kernel")
        merge = kernel_us(r["kernels_us"], "_context_merge_kernel")
        gap = None if split is None or merge is None else r["graph_us"] - split - merge
        lines.append(f"| {r['ctx']} | {r['pdl']} ({r['uses_pdl']}) | {r['splits']} | {r['graph_us']:.1f} | "
                     f"{fmt(split, '.2f')} | {fmt(merge, '.2f')} | {fmt(gap, '.2f')} |")
    lines += ["", "All kernels seen: " + "; ".join(f"ctx {r['ctx']} {r['pdl']}: {r['kernels_us']}"
                                                 for r in result["breakdown"]), "",
              "## 3. Split path launch configs (grid splits as planned)", "",
              "| B | NKV | ctx | splits | block_n | warps | stages | merge rows x cols | merge chunk "
              "| us | GB/s | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["tiles"]:
        c, us = r["config"], r.get("us")
        note = "default" if r["default"] else ""
        note = f"{note} {r.get('skipped', '')}".strip()
        gbps = None if us is None else r["kv_bytes"] / us / 1e3
        lines.append(f"| {r['batch']} | {r['nkv']} | {r.get('ctx', 8192)} | {r['splits']} | {c['block_n']} | "
                     f"{c['num_warps']} | {c['num_stages']} | {c['merge_rows']} x {c['merge_cols']} | "
                     f"{c['merge_chunk']} | "
                     f"{fmt(us)} | {fmt(gbps, '.0f')} | {note} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    parser.add_argument("--parts", nargs="+", choices=("sweep", "breakdown", "tiles"),
                        default=["sweep", "breakdown", "tiles"])
    parser.add_argument("--budget-s", type=float, default=80.0,
                        help="seconds; no new case starts after this (later rows skip)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    deadline = cab.Deadline(args.budget_s)
    result = {"device": torch.cuda.get_device_name(), "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__, "pdl_available": pdl.use_pdl(device),
              "command": f"python -m bench.bench_context_latency {shlex.join(sys.argv[1:])}".strip(),
              "copy_bw": cab.copy_bandwidth(device), "default_splits": split_kv.plan_max_splits(NKV, device),
              "sweep": [], "breakdown": [], "tiles": []}
    torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    stages = [("sweep", lambda: split_sweep(device, gen, result["copy_bw"], deadline)),
              ("breakdown", lambda: kernel_breakdown(device, gen, deadline)),
              ("tiles", lambda: tile_sweep(device, gen, deadline))]
    stages = [(name, stage) for name, stage in stages if name in args.parts]
    for name, stage in stages:  # write after each stage: a run cut short keeps what it measured
        result[name] = stage()
        (args.out / "context_latency.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "context_latency.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
