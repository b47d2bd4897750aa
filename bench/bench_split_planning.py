"""Split planning side by side: whole waves (the current `plan_max_splits`) against the earlier rule.

    python -m bench.bench_split_planning --out DIR [--commit HASH]

The earlier rule took cdiv(2 x SMs, items) splits, which can start a third, mostly empty wave of
programs (64 items x 5 splits = 320 programs on 132 SMs); the current one rounds down to whole
waves. Both run in this one process on the same inputs, under CUDA graphs, through each bench's
own timer: the context kernel (bench/bench_context_attention.py: D 128, Q 16, group 4, bf16) and the
paged kernel at decode and verify (bench/bench_paged_attention.py: Qwen3-8B geometry, bf16). Only small
batches are listed: from SM-count items on both rules give one pass.

Also a per-kernel breakdown of the context kernel at B 1, ctx 8192, NKV 4 (torch.profiler, no
graph): how much of the call is the split kernel and how much the merge.
Writes DIR/split_planning.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
from pathlib import Path
from unittest import mock

import torch
import triton

from bench import bench_context_attention as cab
from bench import bench_paged_attention as pab
from kernels import split_kv
from kernels.paged_tiles import choose_tiles

log = logging.getLogger("bench.bench_split_planning")
current_rule = split_kv.plan_max_splits


def earlier_rule(num_items, device, num_splits=None):
    """The rule before whole waves: ceil, so the grid may overshoot 2 waves by up to one item's splits."""
    if num_splits is not None:
        return num_splits
    sms = split_kv.num_sms(device)
    return 1 if num_items >= sms else min(split_kv.MAX_SPLITS, triton.cdiv(split_kv.WAVES * sms, num_items))


def with_rule(rule, measure):
    with mock.patch.object(split_kv, "plan_max_splits", rule):
        return measure()


def context_rows(device, gen) -> list[dict]:
    rows = []
    for nkv in (4, 8):
        for batch in (1, 2, 4, 8, 12, 16, 24):
            for ctx in (2048, 8192, 32768):
                items = batch * nkv
                if items >= split_kv.num_sms(device):
                    continue
                sets, kv_bytes = cab.make_sets(batch, ctx, nkv, "bf16", device, gen)
                row = {"kernel": "context", "nkv": nkv, "batch": batch, "ctx": ctx, "q_len": cab.NUM_Q,
                       "items": items, "kv_bytes": kv_bytes,
                       "splits_earlier": earlier_rule(items, device),
                       "splits_now": current_rule(items, device)}
                run = functools.partial(cab.time_ours, sets, "bf16")
                row["us_now"] = with_rule(current_rule, run)
                row["us_earlier"] = (row["us_now"] if row["splits_now"] == row["splits_earlier"]
                                     else with_rule(earlier_rule, run))
                rows.append(row)
                log.info("%s", row)
                del sets, run
                torch.cuda.empty_cache()
    return rows


def paged_rows(device) -> list[dict]:
    geo = pab.FULL
    rows = []
    tpb = geo["tpb"]
    pool = pab.Pool(geo, 16 * 32768 + 64 * tpb, torch.bfloat16, device)
    for q_len in (1, 16):
        for batch in (1, 2, 4, 8, 12, 16):
            for ctx in (2048, 8192, 32768):
                tiles = choose_tiles(batch * q_len, batch, geo["heads"] // geo["kv_heads"], geo["head_dim"],
                                     device, torch.bfloat16)
                items = max(batch, triton.cdiv(batch * q_len, tiles.block_q)) * geo["kv_heads"]
                if items >= split_kv.num_sms(device):
                    continue
                run = functools.partial(pab.run_case, geo, pool, "bf16", batch, ctx, q_len, tiles, device, {},
                                        check=False, baseline=False)
                row = {"kernel": "paged", "nkv": geo["kv_heads"], "batch": batch, "ctx": ctx, "q_len": q_len,
                       "items": items, "kv_bytes": batch * ctx * geo["kv_heads"] * geo["head_dim"] * 4,
                       "splits_earlier": earlier_rule(items, device),
                       "splits_now": current_rule(items, device)}
                row["us_now"] = with_rule(current_rule, run)["seconds"] * 1e6
                row["us_earlier"] = (row["us_now"] if row["splits_now"] == row["splits_earlier"]
                                     else with_rule(earlier_rule, run)["seconds"] * 1e6)
                rows.append(row)
                log.info("%s", row)
    return rows


def context_breakdown(device, gen) -> dict:
    """Device time per kernel of one context call at B 1, ctx 8192, NKV 4 (mean over 200 calls)."""
    from torch.profiler import ProfilerActivity, profile

    sets, _ = cab.make_sets(1, 8192, 4, "bf16", device, gen)
    out = torch.empty_like(sets[0]["q"])
    call = lambda s: cab.kernels.paged_context_attention(**s, out=out)
    for s in sets:
        call(s)
    torch.cuda.synchronize()
    calls = 200
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            call(sets[i % len(sets)])
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total and event.count >= calls:
            kernels[event.key[:80]] = {"calls": event.count, "us_per_call": total / event.count}
    return {"case": "B 1, ctx 8192, NKV 4, bf16, no graph", "kernels": kernels,
            "graph_us_per_call": cab.time_ours(sets, "bf16")}


def markdown(result) -> str:
    lines = [f"# Split planning: whole waves vs the earlier rule ({result['device']})", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}, "
             f"triton {result['triton']}, {result['sms']} SMs. Command: `{result['command']}`.", "",
             "Times in us per call under CUDA graphs, same inputs, same process; bf16.", "",
             "| kernel | NKV | B | ctx | q_len | items | splits earlier -> now | earlier us | now us | "
             "now / earlier |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['kernel']} | {r['nkv']} | {r['batch']} | {r['ctx']} | {r['q_len']} | "
                     f"{r['items']} | {r['splits_earlier']} -> {r['splits_now']} | {r['us_earlier']:.1f} | "
                     f"{r['us_now']:.1f} | {r['us_now'] / r['us_earlier']:.3f} |")
    b = result["breakdown"]
    lines += ["", f"## Context kernel breakdown ({b['case']})", "",
              f"Under a CUDA graph: {b['graph_us_per_call']:.1f} us per call.", "",
              "| kernel | us per call (device) |", "|---|---|"]
    lines += [f"| `{name}` | {k['us_per_call']:.2f} |" for name, k in b["kernels"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "sms": split_kv.num_sms(device), "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__,
              "command": f"python -m bench.bench_split_planning --out DIR --commit {args.commit}"}
    result["breakdown"] = context_breakdown(device, gen)
    log.info("%s", result["breakdown"])
    result["rows"] = context_rows(device, gen) + paged_rows(device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "split_planning.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "split_planning.md").write_text(markdown(result))


if __name__ == "__main__":
    main()
