"""fp8 cache, MMA operand dtype side by side: K/V widened to bf16 (q's dtype) or to fp16.

    PYTHONPATH=. python bench/fp8_operands.py --out DIR [--commit HASH] [--part paged|context|both]

An fp8 (e4m3) cache read by the paged kernel is widened for the tensor-core dots. Widening to q's
bf16 measured as slow as reading a bf16 cache (bench/results/paged_attention_notes.md); fp16 holds
every e4m3 value exactly and sm_90 widens a pair of them in one instruction.
`kernels.operands.FP8_WIDEN_DTYPE` (read at launch) picks: None = q's dtype, or fp16. Both run
here on the same inputs, under CUDA graphs, through bench/paged_attention.py's run_case (Qwen3-8B
geometry, 16-token pages shuffled), which also checks each output against SDPA over the gathered,
dequantised K/V. Writes DIR/fp8_operands.{json,md}.
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

import context_attention as cab  # bench/ is sys.path[0]
import paged_attention as pab
import torch
import triton

from kernels import operands
from kernels.paged_attention import choose_tiles

log = logging.getLogger("bench.fp8_operands")
VARIANTS = {"bf16 operands": None, "fp16 operands": torch.float16}


def widened_to(dtype, measure):
    """measure() with fp8 caches widened to `dtype` (None: q's dtype), then the default again."""
    with mock.patch.object(operands, "FP8_WIDEN_DTYPE", dtype):
        return measure()


CASES = [(q, b, c) for q in (1, 8, 16) for b in (1, 8, 32, 128) for c in (2048, 8192)] + [(8192, 1, 8192)]


def measure(geo, pool, batch, ctx, q_len, device) -> dict:
    group = geo["heads"] // geo["kv_heads"]
    tiles = choose_tiles(batch * q_len, batch, group, geo["head_dim"], device, torch.float8_e4m3fn)
    row = {"batch": batch, "ctx": ctx, "q_len": q_len}
    for name, dot in VARIANTS.items():
        rec = widened_to(dot, lambda: pab.run_case(geo, pool, "fp8", batch, ctx, q_len, tiles, device, {},
                                                   check=batch * ctx <= (1 << 20), baseline=False))
        row[name] = {"us": rec["seconds"] * 1e6, "rel_err_vs_sdpa": rec.get("rel_err_vs_sdpa")}
        row["bytes"], row["flops"] = rec["bytes"], rec["flops"]
    return row


CONTEXT_CASES = [(nkv, b, c) for nkv in (4, 8) for b, c in ((1, 8192), (16, 8192), (64, 8192), (256, 2048))]


def measure_context(device, gen, nkv, batch, ctx) -> dict:
    sets, kv_bytes = cab.make_sets(batch, ctx, nkv, "fp8", device, gen)
    row = {"nkv": nkv, "batch": batch, "ctx": ctx, "kv_bytes": kv_bytes}
    for name, dot in VARIANTS.items():
        row[name] = widened_to(dot, functools.partial(cab.time_ours, sets, "fp8"))
    del sets
    torch.cuda.empty_cache()
    return row


def markdown(result) -> str:
    ceil = result["ceilings"]
    lines = [f"# fp8 cache: bf16 or fp16 MMA operands, side by side ({result['device']})", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}, "
             f"triton {result['triton']}. Command: `{result['command']}`. Ceilings measured here: copy "
             f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
             f"{ceil['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s.", "",
             "us per call under CUDA graphs (inputs rotated past L2), same inputs for both columns; in "
             "brackets the relative L2 error against SDPA over the gathered, dequantised K/V where "
             "checked. "
             "The last column rates the fp16 time: % of copy bandwidth (decode, verify) or of the bf16 "
             "matmul rate (the prefill row).", "",
             "| q_len | B | ctx | " + " | ".join(VARIANTS) + " | fp16 / bf16 time | fp16 rate |",
             "|" + "---|" * (5 + len(VARIANTS))]
    for r in result["rows"]:  # paged
        cells = []
        for name in VARIANTS:
            err = r[name]["rel_err_vs_sdpa"]
            cells.append(f"{r[name]['us']:.1f}" + (f" ({err:.1e})" if err is not None else ""))
        fast = r["fp16 operands"]["us"] * 1e-6
        rate = (r["flops"] / fast / ceil["matmul_flop_per_s"] if r["q_len"] > 16
                else r["bytes"] / fast / ceil["copy_bytes_per_s"])
        lines.append(f"| {r['q_len']} | {r['batch']} | {r['ctx']} | " + " | ".join(cells)
                     + f" | {r['fp16 operands']['us'] / r['bf16 operands']['us']:.2f} | {100 * rate:.0f}% |")
    if result.get("context"):
        lines += ["", "## Context kernel (fp8 context, D 128, Q 16, group 4), us per call", "",
                  "| NKV | B | ctx | " + " | ".join(VARIANTS) + " | fp16 / bf16 time | fp16, % of copy |",
                  "|" + "---|" * (5 + len(VARIANTS))]
        for r in result["context"]:
            fast = r["fp16 operands"]
            pct = 100 * r["kv_bytes"] / (fast * 1e-6) / ceil["copy_bytes_per_s"]
            lines.append(f"| {r['nkv']} | {r['batch']} | {r['ctx']} | "
                         + " | ".join(f"{r[name]:.1f}" for name in VARIANTS)
                         + f" | {fast / r['bf16 operands']:.2f} | {pct:.0f}% |")
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
              "command": f"PYTHONPATH=. python bench/fp8_operands.py --out DIR --commit {args.commit} "
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
        pool = pab.Pool(geo, 128 * 8192 + 64 * geo["tpb"], torch.float8_e4m3fn, device)
        for q_len, batch, ctx in CASES:
            result["rows"].append(measure(geo, pool, batch, ctx, q_len, device))
            log.info("%s", result["rows"][-1])
            save()


if __name__ == "__main__":
    main()
