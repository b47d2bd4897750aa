"""fp8 cache, MMA operands side by side: the score dot in fp16 (keys widened) or in e4m3 (q in two terms).

    python -m bench.bench_fp8_operands --out DIR [--commit HASH] [--part paged|context|both]

An fp8 (e4m3) cache read by the attention kernels is widened to fp16 for the tensor-core dots
(`kernels.operands`; widening to q's bf16 instead measured 6-22% slower, bench/results/
fp8_operands*.md of commit 3dce86e and earlier). With `kernels.operands.FP8_QUERIES` the score dot
of 64+-row tiles runs in e4m3 on the stored keys, q split into two e4m3 terms. Both run here on
the same inputs, under CUDA graphs: the paged kernel through bench/bench_paged_attention.py's run_case
(Qwen3-8B geometry, 16-token pages shuffled, each output checked against SDPA over the gathered,
dequantised K/V) for the cases with 64+-row tiles (q_len 16, prefill), the context kernel through
bench/bench_context_attention.py (each output checked against the torch reference). Writes
DIR/fp8_operands.{json,md}.
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

import kernels
from bench import bench_context_attention as cab
from bench import bench_paged_attention as pab
from kernels import operands
from kernels.paged_tiles import choose_tiles

log = logging.getLogger("bench.bench_fp8_operands")
VARIANTS = {"fp16 scores": False, "e4m3 scores": True}  # kernels.operands.FP8_QUERIES
BASE, NEW = VARIANTS


def switched(fp8_queries: bool, measure):
    """measure() with `kernels.operands.FP8_QUERIES` set, then the default again."""
    with mock.patch.object(operands, "FP8_QUERIES", fp8_queries):
        return measure()


POOL_TOKENS = 128 * 8192  # the largest case below
CASES = [(16, b, c) for b in (1, 8, 32, 128, 256) for c in (2048, 8192) if b * c <= POOL_TOKENS]
CASES.append((8192, 1, 8192))  # the prefill


def measure(geo, pool, batch, ctx, q_len, device) -> dict:
    group = geo["heads"] // geo["kv_heads"]
    tiles = choose_tiles(batch * q_len, batch, group, geo["head_dim"], device, torch.float8_e4m3fn)
    row = {"batch": batch, "ctx": ctx, "q_len": q_len}
    for name, switch in VARIANTS.items():
        rec = switched(switch, lambda: pab.run_case(geo, pool, "fp8", batch, ctx, q_len, tiles, device, {},
                                                   check=batch * ctx <= (1 << 20), baseline=False))
        row[name] = {"us": rec["seconds"] * 1e6, "rel_err_vs_sdpa": rec.get("rel_err_vs_sdpa")}
        row["bytes"], row["flops"] = rec["bytes"], rec["flops"]
    return row


CONTEXT_CASES = [(nkv, b, c) for nkv in (4, 8) for b, c in ((1, 8192), (16, 8192), (64, 8192), (256, 2048))]


def context_error(case) -> float:
    """Relative L2 error of one output against the torch reference (fp32 math on the same inputs)."""
    got = kernels.paged_context_attention(**case, **cab.scales("fp8"))
    want = kernels.paged_context_attention(**case, **cab.scales("fp8"), backend="torch")
    return cab.relative_error(got, want)


def measure_context(device, gen, nkv, batch, ctx) -> dict:
    sets, kv_bytes = cab.make_sets(batch, ctx, nkv, "fp8", device, gen)
    row = {"nkv": nkv, "batch": batch, "ctx": ctx, "kv_bytes": kv_bytes}
    for name, switch in VARIANTS.items():
        row[name] = switched(switch, functools.partial(cab.time_ours, sets, "fp8"))
        if batch * ctx <= (1 << 20):
            row[f"{name} rel_err"] = switched(switch, functools.partial(context_error, sets[0]))
    del sets
    torch.cuda.empty_cache()
    return row


def markdown(result) -> str:
    ceil = result["ceilings"]
    lines = [f"# fp8 cache: score dot in fp16 or in e4m3, side by side ({result['device']})", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}, "
             f"triton {result['triton']}. Command: `{result['command']}`. Ceilings measured here: copy "
             f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
             f"{ceil['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s.", "",
             "us per call under CUDA graphs (inputs rotated past L2), same inputs for both columns; in "
             "brackets the relative L2 error against SDPA over the gathered, dequantised K/V where "
             "checked. "
             f"The last column rates the {NEW} time: % of copy bandwidth (verify) or of the bf16 "
             "matmul rate (the prefill row).", "",
             "| q_len | B | ctx | " + " | ".join(VARIANTS) + f" | {NEW} / {BASE} time | {NEW} rate |",
             "|" + "---|" * (5 + len(VARIANTS))]
    for r in result["rows"]:  # paged
        cells = []
        for name in VARIANTS:
            err = r[name]["rel_err_vs_sdpa"]
            cells.append(f"{r[name]['us']:.1f}" + (f" ({err:.1e})" if err is not None else ""))
        fast = r[NEW]["us"] * 1e-6
        rate = (r["flops"] / fast / ceil["matmul_flop_per_s"] if r["q_len"] > 16
                else r["bytes"] / fast / ceil["copy_bytes_per_s"])
        lines.append(f"| {r['q_len']} | {r['batch']} | {r['ctx']} | " + " | ".join(cells)
                     + f" | {r[NEW]['us'] / r[BASE]['us']:.2f} | {100 * rate:.0f}% |")
    if result.get("context"):
        lines += ["", "## Context kernel (fp8 context, D 128, Q 16, group 4), us per call", "",
                  "In brackets the relative L2 error against the torch reference where checked.", "",
                  "| NKV | B | ctx | " + " | ".join(VARIANTS)
                  + f" | {NEW} / {BASE} time | {NEW}, % of copy |",
                  "|" + "---|" * (5 + len(VARIANTS))]
        for r in result["context"]:
            fast = r[NEW]
            pct = 100 * r["kv_bytes"] / (fast * 1e-6) / ceil["copy_bytes_per_s"]
            cells = [f"{r[name]:.1f}" + (f" ({r[name + ' rel_err']:.1e})" if name + " rel_err" in r else "")
                     for name in VARIANTS]
            lines.append(f"| {r['nkv']} | {r['batch']} | {r['ctx']} | " + " | ".join(cells)
                         + f" | {fast / r[BASE]:.2f} | {pct:.0f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    parser.add_argument("--part", choices=("paged", "context", "both"), default="both")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda")
    geo = pab.FULL
    result = {"device": torch.cuda.get_device_name(), "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__,
              "command": f"python -m bench.bench_fp8_operands --out DIR --commit {args.commit} "
                         f"--part {args.part}",
              "ceilings": pab.ceilings(device, smoke=False), "rows": [], "context": []}
    args.out.mkdir(parents=True, exist_ok=True)
    save = lambda: ((args.out / "fp8_operands.json").write_text(json.dumps(result, indent=2) + "\n"),
                    (args.out / "fp8_operands.md").write_text(markdown(result)))
    if args.part != "paged":
        gen = torch.Generator().manual_seed(0)
        for nkv, batch, ctx in CONTEXT_CASES:
            result["context"].append(measure_context(device, gen, nkv, batch, ctx))
            log.info("%s", result["context"][-1])
            save()
    if args.part != "context":
        pool = pab.Pool(geo, POOL_TOKENS + 64 * geo["tpb"], torch.float8_e4m3fn, device)
        for q_len, batch, ctx in CASES:
            result["rows"].append(measure(geo, pool, batch, ctx, q_len, device))
            log.info("%s", result["rows"][-1])
            save()


if __name__ == "__main__":
    main()
