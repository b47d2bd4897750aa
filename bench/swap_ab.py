"""Transposed products for few-row tiles, side by side: S^T = K Q^T and acc^T += V^T P^T, or not.

    PYTHONPATH=. python bench/swap_ab.py --out DIR [--commit HASH]

A decode tile holds one query position x the GQA group (4 rows for Qwen3-8B, padded to 16), so
the usual S = Q K^T puts mostly padding on the MMA's M side, and an fp8 cache's K and V, widened
to bf16, are written back to shared memory as MMA operands. Transposed, the key tile is the M
side. `kernels.paged_attention.SWAP_AB_MAX_ROWS` picks the tiles that swap (read at launch):
0 = none (before), 16 = decode-sized tiles (the default), 64 = verify tiles too. Every variant
runs here on the same inputs, under CUDA graphs, through bench/paged_attention.py's run_case
(Qwen3-8B geometry, 16-token pages shuffled), which also checks each output against SDPA over the
gathered K/V. Writes DIR/swap_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
from pathlib import Path

import paged_attention as pab  # bench/ is sys.path[0]
import torch
import triton

from kernels.paged_attention import choose_tiles

log = logging.getLogger("bench.swap_ab")
paged_module = importlib.import_module("kernels.paged_attention")
DEFAULT = paged_module.SWAP_AB_MAX_ROWS
VARIANTS = {"no swap": 0, "swap <= 16 rows (default)": DEFAULT, "swap <= 64 rows": 64}
CASES = [(b, c) for b in (1, 8, 32, 128) for c in (2048, 8192)] + [(32, 32768)]


def measure(geo, pool, dtype_name, batch, ctx, q_len, device, sdpa_cache) -> dict:
    group = geo["heads"] // geo["kv_heads"]
    tiles = choose_tiles(batch * q_len, batch, group, geo["head_dim"], device, pab.DTYPES[dtype_name])
    row = {"dtype": dtype_name, "batch": batch, "ctx": ctx, "q_len": q_len, "block_m": tiles.block_m}
    for name, rows in VARIANTS.items():
        paged_module.SWAP_AB_MAX_ROWS = rows
        try:
            rec = pab.run_case(geo, pool, dtype_name, batch, ctx, q_len, tiles, device, sdpa_cache,
                               check=batch * ctx <= (1 << 20), baseline=True)
        finally:
            paged_module.SWAP_AB_MAX_ROWS = DEFAULT
        row[name] = {"us": rec["seconds"] * 1e6, "rel_err_vs_sdpa": rec.get("rel_err_vs_sdpa")}
        row["sdpa_us"] = rec["sdpa_seconds"] * 1e6 if rec["sdpa_seconds"] else None
        row["bytes"] = rec["bytes"]
    return row


def markdown(result) -> str:
    copy_bw = result["ceilings"]["copy_bytes_per_s"]
    lines = [f"# Transposed products for few-row tiles, side by side ({result['device']})", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}, "
             f"triton {result['triton']}. "
             f"Command: `{result['command']}`. Copy ceiling measured here: {copy_bw / 1e12:.2f} TB/s.", "",
             "us per call under CUDA graphs (inputs rotated past L2), same inputs for every column; in "
             "brackets the relative L2 error against SDPA over the gathered K/V where checked.", "",
             "| dtype | q_len | B | ctx | rows | " + " | ".join(VARIANTS)
             + " | SDPA (bf16) | default, % copy |",
             "|" + "---|" * (7 + len(VARIANTS))]
    for r in result["rows"]:
        cells = []
        for name in VARIANTS:
            err = r[name]["rel_err_vs_sdpa"]
            cells.append(f"{r[name]['us']:.1f}" + (f" ({err:.1e})" if err is not None else ""))
        sdpa = f"{r['sdpa_us']:.1f}" if r["sdpa_us"] else "-"
        pct = 100 * r["bytes"] / (r["swap <= 16 rows (default)"]["us"] * 1e-6) / copy_bw
        lines.append(f"| {r['dtype']} | {r['q_len']} | {r['batch']} | {r['ctx']} | {r['block_m']} | "
                     + " | ".join(cells) + f" | {sdpa} | {pct:.0f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda")
    geo = pab.FULL
    result = {"device": torch.cuda.get_device_name(), "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__,
              "command": f"PYTHONPATH=. python bench/swap_ab.py --out DIR --commit {args.commit}",
              "ceilings": pab.ceilings(device, smoke=False), "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    sdpa_cache = {}
    for dtype_name, dtype in pab.DTYPES.items():
        pool = pab.Pool(geo, 32 * 32768 + 64 * geo["tpb"], dtype, device)
        for q_len in (1, 8, 16):
            for batch, ctx in CASES:
                result["rows"].append(measure(geo, pool, dtype_name, batch, ctx, q_len, device, sdpa_cache))
                log.info("%s", result["rows"][-1])
            (args.out / "swap_ab.json").write_text(json.dumps(result, indent=2) + "\n")
            (args.out / "swap_ab.md").write_text(markdown(result))
        del pool
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
