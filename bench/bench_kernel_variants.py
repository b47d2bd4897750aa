"""Attention kernel sources side by side: the working tree against other versions, one process.

    python -m bench.bench_kernel_variants --out DIR --variant base=DIR1 [--variant NAME=DIR2 ...]
        [--commit HASH] [--part paged|context|both|shapes] [--cache bf16|fp8] [--q-len N] [--budget-s 420]

A variant directory holds `paged_attention_kernel.py` and/or `context_attention_kernel.py` (or,
from before the launcher was split off, `context_attention.py`), other versions of the working
tree's files with the same launch arguments (for example
``git show COMMIT:kernels/paged_attention_kernel.py``). Each is imported under its own module
name and its jitted kernels are swapped into the working tree's launchers
(`kernels.paged_attention._paged_attention_kernel`, `kernels.context_attention`'s split and merge
kernels) while its column is timed, so every column runs the same launcher, tiles and split plan
on the same inputs. A variant without a file for a kernel reuses the working tree's; constexpr
keywords the launcher passes that an older variant does not declare are dropped for it.

Timing is bench/bench_paged_attention.py's (Qwen3-8B geometry, 16-token pages shuffled, one CUDA graph
over rotated block tables, median of replays; outputs checked against SDPA over the gathered K/V
where B x ctx <= 1M) and bench/bench_context_attention.py's (D 128, Q 16, group 4, 32-token pages).
After the source variants (paged, then context), launch-shape variants of the working tree's
paged kernel run on the same inputs (`SHAPE_VARIANTS`: other tiles, a forced split count), each
next to the default, then tiles of the context kernel's single pass (`CONTEXT_SHAPES`, with
`--part shapes` or `context`) next to its default (`--part shapes`: only the shape variants).
`--cache` keeps the cases of one cache dtype.
Writes DIR/kernel_variants.{json,md} after every case.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import triton

from bench import bench_context_attention as cab
from bench import bench_paged_attention as pab
from kernels import context_attention as ca
from kernels import split_kv
from kernels.paged_tiles import TileConfig, default_tiles

log = logging.getLogger("bench.bench_kernel_variants")
pa = importlib.import_module("kernels.paged_attention")  # the package exports a function of that name
NOW = "now"
# (cache, q_len, B, ctx): decode, verify and the 8k prefill, where the targets are missed
PAGED_CASES = [
    ("bf16", 1, 1, 2048), ("bf16", 1, 1, 8192), ("bf16", 1, 8, 2048), ("bf16", 1, 32, 2048),
    ("bf16", 1, 128, 8192), ("bf16", 1, 256, 2048),
    ("bf16", 8, 32, 8192), ("bf16", 8, 128, 2048), ("bf16", 16, 32, 8192), ("bf16", 16, 128, 2048),
    ("bf16", 8192, 1, 8192),
    ("fp8", 1, 1, 8192), ("fp8", 1, 32, 2048), ("fp8", 1, 128, 8192), ("fp8", 4, 32, 8192),
    ("fp8", 8, 32, 8192), ("fp8", 16, 128, 2048), ("fp8", 8192, 1, 8192),
]
# (cache, NKV, B, ctx)
CONTEXT_CASES = [
    ("bf16", 4, 1, 8192), ("bf16", 4, 4, 32768), ("bf16", 4, 16, 8192), ("bf16", 8, 64, 8192),
    ("bf16", 4, 256, 2048), ("fp8", 4, 1, 8192), ("fp8", 4, 16, 8192), ("fp8", 8, 64, 8192),
    ("fp8", 4, 256, 2048),
]
# (name, cache, q_len, B, ctx, tiles or None for the default, num_splits or None for the plan)
SHAPE_VARIANTS = [  # earlier sets are in bench/results/kernel_variants_*.json
    # the fp8 prefill's previous tile (128 x 128 on 8 warps, 5 stages) next to the 64-row default, twice
    *[(f"fp8 prefill, previous tile ({i})", "fp8", 8192, 1, 8192, TileConfig(32, 128, 128, 8, 5), None)
      for i in (1, 2)],
]
# (name, cache, NKV, B, ctx, LaunchConfig[, least keys per split]) of the context kernel, next to
# its default
CONTEXT_SHAPES = []


def pool_tokens(cache: str, part: str, tpb: int) -> int:
    """Tokens of the `cache` pool: the largest paged case of this run in one set, at least 1M."""
    cases = [(q, b, c) for d, q, b, c in PAGED_CASES if d == cache and part != "shapes"]
    cases += [(q, b, c) for _, d, q, b, c, _, _ in SHAPE_VARIANTS if d == cache]
    return max([128 * 8192] + [b * triton.cdiv(c + q, tpb) * tpb for q, b, c in cases]) + 64 * tpb


def load_variant(name: str, directory: Path) -> dict:
    """{file stem: module} for the kernel files present in `directory`."""
    modules = {}
    for stem in ("paged_attention_kernel", "context_attention_kernel", "context_attention"):
        path = directory / f"{stem}.py"
        if path.exists():
            spec = importlib.util.spec_from_file_location(f"variant_{name}_{stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses look their module up while it executes
            spec.loader.exec_module(module)
            modules[stem] = module
    if not modules:
        raise SystemExit(f"variant {name}: {directory} holds none of paged_attention_kernel.py, "
                         f"context_attention_kernel.py, context_attention.py")
    return modules


class _OlderSignature:
    """A variant kernel launched by the working tree's launcher: constexpr keywords (upper case)
    that the variant does not declare, added since it was written, are dropped."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            kept = {k: v for k, v in kwargs.items() if not k.isupper() or k in self.kernel.arg_names}
            return launch(*args, **kept)

        return call


def swapped_in(modules: dict) -> contextlib.ExitStack:
    """The variant's kernels in the working tree's launchers, restored when the block exits."""
    stack = contextlib.ExitStack()
    if "paged_attention_kernel" in modules:
        paged = modules["paged_attention_kernel"]
        stack.enter_context(mock.patch.object(pa, "_paged_attention_kernel",
                                              _OlderSignature(paged._paged_attention_kernel)))
    # the context kernels' file; before the launcher was split off they lived in context_attention.py
    context = modules.get("context_attention_kernel") or modules.get("context_attention")
    if context is not None:
        for name in ("_context_attention_kernel", "_context_merge_kernel"):
            stack.enter_context(mock.patch.object(ca, name, _OlderSignature(getattr(context, name))))
    return stack


def paged_rate(rec, ceil) -> float:
    """% of the copy bandwidth (decode, verify) or of the bf16 matmul rate (prefill)."""
    if rec["q_len"] > 16:
        return 100 * rec["flops"] / rec["seconds"] / ceil["matmul_flop_per_s"]
    return 100 * rec["bytes"] / rec["seconds"] / ceil["copy_bytes_per_s"]


def measure_paged(geo, pools, variants, case, device) -> dict:
    dtype_name, q_len, batch, ctx = case
    cache = pab.DTYPES[dtype_name]
    tiles = default_tiles(batch * q_len, batch, geo["heads"], geo["kv_heads"], geo["head_dim"], device, cache)
    row = {"cache": dtype_name, "q_len": q_len, "batch": batch, "ctx": ctx, "tiles": tiles._asdict(),
           "us": {}, "err": {}}
    for name, modules in variants.items():
        with swapped_in(modules):
            rec = pab.run_case(geo, pools[dtype_name], dtype_name, batch, ctx, q_len, tiles, device, {},
                               check=batch * ctx <= (1 << 20), baseline=False)
        row["us"][name] = rec["seconds"] * 1e6
        row["err"][name] = rec.get("rel_err_vs_sdpa")
        row["bytes"], row["flops"] = rec["bytes"], rec["flops"]
    return row


def measure_context(device, gen, variants, case) -> dict:
    dtype_name, nkv, batch, ctx = case
    sets, kv_bytes = cab.make_sets(batch, ctx, nkv, dtype_name, device, gen)
    row = {"cache": dtype_name, "nkv": nkv, "batch": batch, "ctx": ctx, "kv_bytes": kv_bytes, "us": {},
           "err": {}}
    ref = ca.reference.paged_context_attention(**sets[0], **cab.scales(dtype_name))
    for name, modules in variants.items():
        with swapped_in(modules):
            row["us"][name] = cab.time_ours(sets, dtype_name)
            got = ca.paged_context_attention(**sets[0], **cab.scales(dtype_name))
        row["err"][name] = cab.relative_error(got, ref)
    del sets
    torch.cuda.empty_cache()
    return row


def measure_shape(geo, pools, variant, device) -> dict:
    name, dtype_name, q_len, batch, ctx, tiles, num_splits = variant
    default = default_tiles(batch * q_len, batch, geo["heads"], geo["kv_heads"], geo["head_dim"], device,
                            pab.DTYPES[dtype_name])
    row = {"name": name, "cache": dtype_name, "q_len": q_len, "batch": batch, "ctx": ctx, "us": {}}
    for label, t, splits in (("default", default, None), ("variant", tiles or default, num_splits)):
        rec = pab.run_case(geo, pools[dtype_name], dtype_name, batch, ctx, q_len, t, device, {},
                           check=batch * ctx <= (1 << 20), baseline=False, num_splits=splits)
        row["us"][label] = rec["seconds"] * 1e6
        row[f"{label}_tiles"] = t._asdict()
        row[f"{label}_err"] = rec.get("rel_err_vs_sdpa")
        row["bytes"], row["flops"], row["seconds"] = rec["bytes"], rec["flops"], rec["seconds"]
    return row


def tile_text(t: dict) -> str:
    return (f"{t['block_q']}, {t['block_m']}, {t['block_n']}, {t['num_warps']}, {t['num_stages']}, "
            f"{t.get('key_lanes', 1)}")


def measure_context_shape(device, gen, variant) -> dict:
    """The context kernel with its default tiles and with `variant`'s, same inputs and split plan."""
    name, dtype_name, nkv, batch, ctx, config, variant_min_tokens = (*variant, None)[:7]
    sets, kv_bytes = cab.make_sets(batch, ctx, nkv, dtype_name, device, gen)
    rows = cab.NUM_Q * cab.GROUP
    max_splits = split_kv.plan_max_splits(batch * nkv, device)
    min_tokens = split_kv.min_tokens_per_split(rows)
    default = ca.default_config(rows, cab.cache_dtype(dtype_name), device)
    ref = ca.reference.paged_context_attention(**sets[0], **cab.scales(dtype_name))
    row = {"name": name, "cache": dtype_name, "nkv": nkv, "batch": batch, "ctx": ctx, "kv_bytes": kv_bytes,
           "max_splits": max_splits, "us": {}, "err": {}, "configs": {}}
    columns = (("default", default, min_tokens), ("variant", config, variant_min_tokens or min_tokens))
    for label, cfg, floor in columns:
        launches = [cab._configured_launch(s, dtype_name, max_splits, floor, cfg) for s in sets]
        row["us"][label] = cab.time_graph(launches)
        row["err"][label] = cab.relative_error(launches[0](), ref)
        row["configs"][label] = dataclasses.asdict(cfg) | {"min_tokens_per_split": floor}
    del sets
    torch.cuda.empty_cache()
    return row


def markdown(result) -> str:
    ceil = result["ceilings"]
    names = list(result["variants"])
    base = names[1] if len(names) > 1 else names[0]
    lines = [f"# Attention kernel variants side by side ({result['device']})", "",
             f"commit `{result['commit']}`, {result['date']}, torch {result['torch']}, triton "
             f"{result['triton']}. Command: `{result['command']}`. Variants: "
             + ", ".join(f"`{k}` = {v}" for k, v in result["variants"].items()) + ". Ceilings measured "
             f"here: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
             f"{ceil['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s.", "",
             "us per call under CUDA graphs, same inputs in every column; the rate of the working tree "
             f"(`{NOW}`) is % of copy bandwidth (decode, verify, context) or of the bf16 matmul rate "
             "(prefill); the ratio is its time over the first other variant's. Worst relative L2 error "
             "against SDPA (paged, where checked) or the torch reference (context) over the columns.", "",
             "## Paged kernel", "",
             "| cache | q_len | B | ctx | " + " | ".join(names) + f" | {NOW} / {base} | {NOW} rate | error |",
             "|" + "---|" * (7 + len(names))]
    for r in result["paged"]:
        rate = paged_rate({**r, "seconds": r["us"][NOW] * 1e-6}, ceil)
        errs = [e for e in r["err"].values() if e is not None]
        lines.append(f"| {r['cache']} | {r['q_len']} | {r['batch']} | {r['ctx']} | "
                     + " | ".join(f"{r['us'][n]:.1f}" for n in names)
                     + f" | {r['us'][NOW] / r['us'][base]:.3f} | {rate:.0f}% | "
                     + (f"{max(errs):.1e}" if errs else "-") + " |")
    lines += ["", "## Context kernel (D 128, Q 16, group 4)", "",
              "| cache | NKV | B | ctx | " + " | ".join(names) + f" | {NOW} / {base} | {NOW} rate | error |",
              "|" + "---|" * (7 + len(names))]
    for r in result["context"]:
        rate = 100 * r["kv_bytes"] / (r["us"][NOW] * 1e-6) / ceil["copy_bytes_per_s"]
        lines.append(f"| {r['cache']} | {r['nkv']} | {r['batch']} | {r['ctx']} | "
                     + " | ".join(f"{r['us'][n]:.1f}" for n in names)
                     + f" | {r['us'][NOW] / r['us'][base]:.3f} | {rate:.0f}% | "
                     + f"{max(r['err'].values()):.1e} |")
    lines += ["", f"## Launch shapes of the paged kernel (`{NOW}`), next to its defaults", "",
              "Tiles: q, m, n, warps, stages, key lanes.", "",
              "| variant | cache | q_len | B | ctx | default us | variant us | variant / default | "
              "default rate | variant rate | default tiles | variant tiles |", "|" + "---|" * 12]
    for r in result["shapes"]:
        rates = [paged_rate({**r, "seconds": r["us"][key] * 1e-6}, ceil) for key in ("default", "variant")]
        lines.append(f"| {r['name']} | {r['cache']} | {r['q_len']} | {r['batch']} | {r['ctx']} | "
                     f"{r['us']['default']:.1f} | {r['us']['variant']:.1f} | "
                     f"{r['us']['variant'] / r['us']['default']:.3f} | {rates[0]:.0f}% | {rates[1]:.0f}% | "
                     f"{tile_text(r['default_tiles'])} | {tile_text(r['variant_tiles'])} |")
    lines += ["", "## Tiles of the context kernel, next to its defaults (the public split plan)", "",
              "Tiles: keys, warps, stages, least keys per split.", "",
              "| variant | cache | NKV | B | ctx | default us | variant us | variant / default | "
              "default rate | variant rate | default tiles | variant tiles | error |", "|" + "---|" * 13]
    for r in result.get("context_shapes", []):
        both = ("default", "variant")
        rates = [100 * r["kv_bytes"] / (r["us"][k] * 1e-6) / ceil["copy_bytes_per_s"] for k in both]
        cfgs = [r["configs"][k] for k in both]
        lines.append(f"| {r['name']} | {r['cache']} | {r['nkv']} | {r['batch']} | {r['ctx']} | "
                     f"{r['us']['default']:.1f} | {r['us']['variant']:.1f} | "
                     f"{r['us']['variant'] / r['us']['default']:.3f} | {rates[0]:.0f}% | {rates[1]:.0f}% | "
                     + " | ".join(f"{c['block_n']}, {c['num_warps']}, {c['num_stages']}, "
                                  f"{c.get('min_tokens_per_split', '-')}" for c in cfgs)
                     + f" | {max(r['err'].values()):.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                        help="another version of the kernel files (repeatable)")
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    parser.add_argument("--part", choices=("paged", "context", "both", "shapes"), default="both",
                        help="shapes: only the launch-shape variants")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting cases after this")
    parser.add_argument("--cache", choices=("bf16", "fp8"), help="only the cases of this cache dtype")
    parser.add_argument("--q-len", type=int, help="only the paged cases of this query count")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    variants = {NOW: {}}
    described = {NOW: "the working tree"}
    for spec in args.variant:
        name, sep, directory = spec.partition("=")
        if not sep or not name or name in variants:
            raise SystemExit(f"--variant takes NAME=DIR with a new NAME, got {spec!r}")
        variants[name] = load_variant(name, Path(directory))
        described[name] = f"{directory} ({', '.join(variants[name])})"
    device = torch.device("cuda")
    end = time.monotonic() + args.budget_s
    result = {"device": torch.cuda.get_device_name(), "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__, "variants": described,
              "command": "python -m bench.bench_kernel_variants --out DIR "
                         + " ".join(f"--variant {v}" for v in args.variant)
                         + f" --commit {args.commit} --part {args.part}"
                         + (f" --cache {args.cache}" if args.cache else "")
                         + (f" --q-len {args.q_len}" if args.q_len else ""),
              "ceilings": pab.ceilings(device, smoke=False), "paged": [], "context": [], "shapes": [],
              "context_shapes": []}
    args.out.mkdir(parents=True, exist_ok=True)

    def save():
        (args.out / "kernel_variants.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "kernel_variants.md").write_text(markdown(result))

    geo = pab.FULL
    pools = {}
    if args.part != "context":
        pools = {name: pab.Pool(geo, pool_tokens(name, args.part, geo["tpb"]), dtype, device)
                 for name, dtype in pab.DTYPES.items() if args.cache in (None, name)}
        for case in PAGED_CASES if args.part != "shapes" else ():
            if time.monotonic() < end and args.cache in (None, case[0]) and args.q_len in (None, case[1]):
                result["paged"].append(measure_paged(geo, pools, variants, case, device))
                log.info("%s", result["paged"][-1])
                save()
    if args.part in ("context", "both"):
        gen = torch.Generator().manual_seed(0)
        for case in CONTEXT_CASES:
            if time.monotonic() < end and args.cache in (None, case[0]):
                result["context"].append(measure_context(device, gen, variants, case))
                log.info("%s", result["context"][-1])
                save()
    for variant in SHAPE_VARIANTS if pools else ():
        if time.monotonic() < end and args.cache in (None, variant[1]):
            result["shapes"].append(measure_shape(geo, pools, variant, device))
            log.info("%s", result["shapes"][-1])
            save()
    pools.clear()
    torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(1)
    for variant in CONTEXT_SHAPES if args.part in ("context", "shapes") else ():
        if time.monotonic() < end and args.cache in (None, variant[1]):
            result["context_shapes"].append(measure_context_shape(device, gen, variant))
            log.info("%s", result["context_shapes"][-1])
            save()
    save()


if __name__ == "__main__":
    main()
