"""Small-batch latency fixes, ablated cumulatively in one process: PDL, merge in the last split,
one-load sequence search.

    python -m bench.bench_latency_ablation --out DIR [--commit HASH]

Small batches are latency bound: dependent kernels (split, merge), their launch gap, and chains
of dependent loads in each program cost as much as the bytes. Three remedies, each behind a
switch read at launch, are added one at a time:
- `kernels.pdl.ENABLED`: programmatic dependent launch (a kernel's programs start while the one
  before it finishes, and wait for its writes);
- `kernels.paged_attention.FUSED_MERGE_MAX_SPLITS`: the paged kernel's last split of each
  (tile, head) merges the partials itself when its rule holds (verify blocks split at most that
  many ways); 0 turns it off, so a merge kernel always runs;
- `kernels.paged_attention.SEQ_SEARCH`: each program of a verify or prefill batch finds its
  sequence with one load of 64 query_start_loc entries (1: the binary search, log2(B) dependent
  loads; pure decode batches always bisect, the rule set after the first run of this bench).
Every variant runs on the same inputs, under CUDA graphs, with pab's timer (bench/bench_paged_attention.py:
Qwen3-8B geometry) and cab's (bench/bench_context_attention.py: D 128, Q 16, group 4), next to SDPA over
the same K/V gathered dense.

Two ways to time a call: back to back (the graph holds only attention calls, as the kernel
benches do; with PDL each call may overlap the previous call's tail), and "after another
kernel" (each call follows a small elementwise kernel that rewrites q, as the projection before
attention does; that kernel's own time, measured alone in the same way, is subtracted). The
second is what a model sees. Writes DIR/latency_ablation.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import logging
import os
from pathlib import Path

import torch
import triton

import kernels
from bench import bench_context_attention as cab
from bench import bench_paged_attention as pab
from kernels import pdl, split_kv
from kernels.paged_attention import _launch_paged_attention
from kernels.paged_tiles import choose_tiles

log = logging.getLogger("bench.bench_latency_ablation")
paged_module = importlib.import_module("kernels.paged_attention")
DEFAULTS = {"pdl": pdl.ENABLED, "fused": paged_module.FUSED_MERGE_MAX_SPLITS,
            "search": paged_module.SEQ_SEARCH}
BEFORE = {"pdl": False, "fused": 0, "search": 1}
PAGED_VARIANTS = {  # cumulative: each adds one switch to the one before
    "before": BEFORE,
    "+ PDL": dict(BEFORE, pdl=DEFAULTS["pdl"]),
    "+ merge in last split": dict(BEFORE, pdl=DEFAULTS["pdl"], fused=DEFAULTS["fused"]),
    "+ one-load search (now)": DEFAULTS,
}
CONTEXT_VARIANTS = {"no PDL": dict(DEFAULTS, pdl=False), "PDL (now)": DEFAULTS}


def set_switches(switches: dict) -> None:
    pdl.ENABLED = switches["pdl"]
    paged_module.FUSED_MERGE_MAX_SPLITS = switches["fused"]
    paged_module.SEQ_SEARCH = switches["search"]


def with_switches(switches: dict, measure):
    set_switches(switches)
    try:
        return measure()
    finally:
        set_switches(DEFAULTS)


def both_timings(calls, touch_inputs) -> dict:
    """us per call back to back, and after a small non-PDL kernel (its own time subtracted)."""
    n = len(calls)
    back_to_back = pab.time_calls(calls, torch.device("cuda")) * 1e6
    pre = [touch_inputs(i) for i in range(n)]
    interleaved = [c for pair in zip(pre, calls) for c in pair]
    total = pab.time_calls(interleaved, torch.device("cuda")) * 1e6 * 2 * n
    alone = pab.time_calls(pre, torch.device("cuda")) * 1e6 * n
    return {"back_to_back_us": back_to_back, "after_kernel_us": (total - alone) / n}


def paged_rows(device) -> list[dict]:
    geo = pab.FULL
    rows = []
    for dtype_name, dtype in pab.DTYPES.items():
        pool = pab.Pool(geo, 128 * 8192 + 64 * geo["tpb"], dtype, device)
        for q_len in (1, 8):
            for batch in (1, 2, 4, 8, 16, 32, 128):
                for ctx in (2048, 8192, 32768):
                    if batch * ctx > 128 * 8192:
                        continue
                    rows.append(paged_case(geo, pool, dtype_name, batch, ctx, q_len, device))
                    log.info("%s", rows[-1])
        del pool
        torch.cuda.empty_cache()
    return rows


def paged_case(geo, pool, dtype_name, batch, ctx, q_len, device) -> dict:
    heads, head_dim = geo["heads"], geo["head_dim"]
    group = heads // geo["kv_heads"]
    pages = triton.cdiv(ctx, geo["tpb"])
    kv_bytes = batch * ctx * geo["kv_heads"] * head_dim * 2 * pool.arena.element_size()
    sets = max(1, min(pab.MAX_SETS, triton.cdiv(pab.ROTATE_BYTES, kv_bytes),
                      pool.num_blocks // (batch * pages)))
    tables = pool.tables(batch, pages, sets)
    qs = [torch.randn(batch * q_len, heads, head_dim, device=device, dtype=torch.bfloat16) for _ in tables]
    out = torch.empty_like(qs[0])
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    starts = (torch.arange(batch + 1, device=device) * q_len).int()
    scales = {}
    if dtype_name == "fp8":
        scales = dict(k_scale=torch.tensor(pab.K_SCALE, device=device),
                      v_scale=torch.tensor(pab.V_SCALE, device=device))
    tiles = choose_tiles(batch * q_len, batch, group, head_dim, device, pool.k.dtype)
    calls = [functools.partial(_launch_paged_attention, q, pool.k, pool.v, t, seq_lens, starts, None,
                               scales.get("k_scale"), scales.get("v_scale"), None, out, tiles)
             for q, t in zip(qs, tables)]
    touch = lambda i: functools.partial(torch.mul, qs[i], 1.0, out=qs[i])
    row = {"kernel": "paged", "dtype": dtype_name, "batch": batch, "ctx": ctx, "q_len": q_len,
           "kv_bytes": kv_bytes,
           "items": max(batch, triton.cdiv(batch * q_len, tiles.block_q)) * geo["kv_heads"]}
    row["splits"] = split_kv.plan_max_splits(row["items"], device)
    for name, switches in PAGED_VARIANTS.items():
        row[name] = with_switches(switches, lambda: both_timings(calls, touch))
    if dtype_name == "bf16":
        dense = [pool.dense(t, ctx) for t in tables]
        qd = [q.view(batch, q_len, heads, head_dim).transpose(1, 2) for q in qs]
        sdpa = [pab.sdpa_call(q, k, v, q_len, ctx) for q, (k, v) in zip(qd, dense)]
        row["sdpa"] = both_timings(sdpa, touch)
        del dense
    return row


def context_rows(device, gen) -> list[dict]:
    rows = []
    for dtype_name in ("bf16", "fp8"):
        for nkv in (4, 8):
            for batch in (1, 4, 64):
                for ctx in (2048, 8192, 32768):
                    if batch == 64 and ctx != 8192:
                        continue
                    rows.append(context_case(device, gen, dtype_name, nkv, batch, ctx))
                    log.info("%s", rows[-1])
                    torch.cuda.empty_cache()
    return rows


def context_case(device, gen, dtype_name, nkv, batch, ctx) -> dict:
    sets, kv_bytes = cab.make_sets(batch, ctx, nkv, dtype_name, device, gen)
    outs = [torch.empty_like(s["q"]) for s in sets]
    calls = [functools.partial(kernels.paged_context_attention, **s, out=o, **cab.scales(dtype_name))
             for s, o in zip(sets, outs)]
    touch = lambda i: functools.partial(torch.mul, sets[i]["q"], 1.0, out=sets[i]["q"])
    row = {"kernel": "context", "dtype": dtype_name, "nkv": nkv, "batch": batch, "ctx": ctx,
           "kv_bytes": kv_bytes, "splits": split_kv.plan_max_splits(batch * nkv, device)}
    for name, switches in CONTEXT_VARIANTS.items():
        row[name] = with_switches(switches, lambda: both_timings(calls, touch))
    return row


def device_times(calls, sdpa_calls=None, repeats=100) -> dict:
    """Device us per call of each kernel (torch.profiler, eager, no graph): where a call's time goes."""
    from torch.profiler import ProfilerActivity, profile

    for call in calls:
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(repeats):
            calls[i % len(calls)]()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total and event.count >= repeats:
            times[event.key[:70]] = round(total / event.count, 2)
    return times


def breakdowns(device, gen) -> list[dict]:
    """Per-kernel device time at B 1: paged decode (ours and SDPA's kernels) and the context kernel."""
    geo = pab.FULL
    pool = pab.Pool(geo, 64 * 8192, torch.bfloat16, device)
    rows = []
    for ctx in (2048, 8192):
        tables = pool.tables(1, triton.cdiv(ctx, geo["tpb"]), 32)
        q = torch.randn(1, geo["heads"], geo["head_dim"], device=device, dtype=torch.bfloat16)
        seq_lens = torch.full((1,), ctx, dtype=torch.int32, device=device)
        starts = torch.tensor([0, 1], dtype=torch.int32, device=device)
        calls = [functools.partial(kernels.paged_attention, q, pool.k, pool.v, t, seq_lens, starts)
                 for t in tables]
        dense = [pool.dense(t, ctx) for t in tables[:8]]
        qd = q.view(1, 1, geo["heads"], geo["head_dim"]).transpose(1, 2)
        sdpa = [pab.sdpa_call(qd, k, v, 1, ctx) for k, v in dense]
        rows.append({"case": f"paged decode bf16 B 1 ctx {ctx}", "ours": device_times(calls),
                     "sdpa": device_times(sdpa)})
        log.info("%s", rows[-1])
    sets, _ = cab.make_sets(1, 8192, 4, "bf16", device, gen)
    outs = [torch.empty_like(s["q"]) for s in sets]
    calls = [functools.partial(kernels.paged_context_attention, **s, out=o) for s, o in zip(sets, outs)]
    rows.append({"case": "context bf16 B 1 ctx 8192 NKV 4", "ours": device_times(calls)})
    log.info("%s", rows[-1])
    return rows


def _cell(timing: dict | None) -> str:
    if timing is None:
        return "-"
    return f"{timing['back_to_back_us']:.1f} / {timing['after_kernel_us']:.1f}"


def markdown(result) -> str:
    lines = [f"# Small-batch latency fixes, ablated cumulatively ({result['device']})", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}, "
             f"triton {result['triton']}, PDL available: {result['pdl_available']}. "
             f"Command: `{result['command']}`.", "",
             "Each cell: us per call back to back / us per call after another (non-PDL) kernel, under CUDA "
             "graphs, inputs rotated past L2, same inputs and process for every column.", "",
             "## Paged attention (Qwen3-8B geometry: 32 heads, 8 KV heads, D 128)", ""]
    names = [*PAGED_VARIANTS, "sdpa"]
    copy_bw = result["ceilings"]["copy_bytes_per_s"]
    lines.insert(4, f"Copy ceiling measured in this run: {copy_bw / 1e12:.2f} TB/s (pab.ceilings).")
    lines.insert(5, "")
    lines += ["| dtype | q_len | B | ctx | splits | " + " | ".join(names)
              + " | SDPA / now (after kernel) | now, % of copy BW |",
              "|" + "---|" * (7 + len(names))]
    for r in result["paged"]:
        ratio = "-"
        if r.get("sdpa"):
            ratio = f"{r['sdpa']['after_kernel_us'] / r['+ one-load search (now)']['after_kernel_us']:.2f}x"
        now_s = r["+ one-load search (now)"]["back_to_back_us"] * 1e-6
        lines.append(f"| {r['dtype']} | {r['q_len']} | {r['batch']} | {r['ctx']} | {r['splits']} | "
                     + " | ".join(_cell(r.get(n)) for n in names)
                     + f" | {ratio} | {100 * r['kv_bytes'] / now_s / copy_bw:.0f}% |")
    lines += ["", "## Context attention (D 128, Q 16, group 4)", "",
              "| dtype | NKV | B | ctx | splits | " + " | ".join(CONTEXT_VARIANTS) + " |",
              "|" + "---|" * (5 + len(CONTEXT_VARIANTS))]
    for r in result["context"]:
        lines.append(f"| {r['dtype']} | {r['nkv']} | {r['batch']} | {r['ctx']} | {r['splits']} | "
                     + " | ".join(_cell(r[n]) for n in CONTEXT_VARIANTS) + " |")
    lines += ["", "## Device time per kernel at B 1 (torch.profiler, eager, mean of 100 calls)", ""]
    for b in result["breakdowns"]:
        for who in ("ours", "sdpa"):
            if who in b:
                cells = ", ".join(f"`{name}` {us:.2f} us" for name, us in b[who].items())
                lines.append(f"- {b['case']}, {who}: {cells}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    parser.add_argument("--only", choices=("paged", "context"), default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__,
              "pdl_available": pdl.use_pdl(device),
              "command": f"python -m bench.bench_latency_ablation --out DIR --commit {args.commit}"}
    args.out.mkdir(parents=True, exist_ok=True)
    result.update(ceilings=pab.ceilings(device, smoke=False), breakdowns=[], paged=[], context=[])
    stages = [("breakdowns", lambda: breakdowns(device, torch.Generator().manual_seed(1)))]
    if args.only != "context":
        stages.append(("paged", lambda: paged_rows(device)))
    if args.only != "paged":
        stages.append(("context", lambda: context_rows(device, torch.Generator().manual_seed(0))))
    for name, stage in stages:  # write after each stage: a run cut short keeps what it measured
        result[name] = stage()
        (args.out / "latency_ablation.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "latency_ablation.md").write_text(markdown(result))


if __name__ == "__main__":
    main()
