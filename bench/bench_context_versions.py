"""The public context attention of another version of its files next to the working tree's, one process.

    git show COMMIT:kernels/context_attention.py > DIR/context_attention.py
    git show COMMIT:kernels/context_attention_kernel.py > DIR/context_attention_kernel.py
    python -m bench.bench_context_versions --base DIR --out OUT [--commit HASH] [--base-commit HASH]

bench/bench_kernel_variants.py swaps kernel sources under the working tree's launcher, so it cannot
compare changes that also move work between the kernels (their launch arguments differ). This
bench imports the other version's launcher with its own kernel module in place of
`kernels.context_attention_kernel` (the rest of `kernels` is shared), and times both public
functions on the same inputs in one process: CUDA graphs over rotated input sets, median of
replays, as bench/bench_context_attention.py (D 128, Q 16, group 4, 32-token pages). Each output is
checked against the torch reference on the first input set. Writes OUT/context_versions.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import shlex
import sys
from pathlib import Path
from unittest import mock

import torch
import triton

import kernels
from bench import bench_context_attention as cab

log = logging.getLogger("bench.bench_context_versions")
# (cache, NKV, B, ctx): B 1 from no context to long (split path, one-split requests included), other
# split batches, and the single pass (B 64)
CASES = [("bf16", 4, 1, 0), ("bf16", 4, 1, 128), ("bf16", 4, 1, 1024), ("bf16", 4, 1, 8192),
         ("bf16", 4, 1, 32768), ("bf16", 8, 1, 8192), ("bf16", 8, 4, 8192), ("bf16", 4, 16, 8192),
         ("bf16", 4, 16, 2048), ("bf16", 4, 64, 8192), ("fp8", 4, 1, 8192), ("fp8", 4, 16, 8192),
         ("fp8", 4, 64, 8192)]


def load_version(directory: Path):
    """The launcher module of `directory`, bound to that directory's kernel module."""
    spec = importlib.util.spec_from_file_location("base_context_attention_kernel",
                                                  directory / "context_attention_kernel.py")
    kernel = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = kernel
    spec.loader.exec_module(kernel)
    spec = importlib.util.spec_from_file_location("base_context_attention",
                                                  directory / "context_attention.py")
    launcher = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = launcher  # dataclasses look their module up while it executes
    with mock.patch.dict(sys.modules, {"kernels.context_attention_kernel": kernel}):
        spec.loader.exec_module(launcher)
    return launcher


def make_case_sets(cache, nkv, batch, ctx, device, gen):
    if ctx == 0:  # make_sets sizes its rotation by the K/V bytes, so it needs ctx > 0
        zero = torch.zeros(batch, dtype=torch.int32)
        sets, _ = cab.make_sets(batch, cab.TPB, nkv, cache, device, gen, ctx_lens=zero)
        return sets, 0
    return cab.make_sets(batch, ctx, nkv, cache, device, gen)


def time_version(function, sets, cache) -> tuple[float, float]:
    """(us per call, relative error of the first set's output against the torch reference)."""
    outs = [torch.empty_like(s["q"]) for s in sets]
    launches = [lambda s=s, o=o: function(**s, out=o, **cab.scales(cache)) for s, o in zip(sets, outs)]
    us = cab.time_graph(launches)
    launches[0]()
    want = kernels.reference.paged_context_attention(**sets[0], **cab.scales(cache)).float()
    error = ((outs[0].float() - want).norm() / want.norm()).item()
    return us, error


def markdown(result) -> str:
    lines = [f"# Context attention, two versions side by side ({result['device']})", "",
             f"`now` = the working tree at commit `{result['commit']}`; `base` = the files of commit "
             f"`{result['base_commit']}`. {result['date']}, torch {result['torch']}, "
             f"triton {result['triton']}. "
             f"Command: `{result['command']}`.", "",
             f"D {cab.HEAD_DIM}, Q {cab.NUM_Q}, group {cab.GROUP}, {cab.TPB}-token pages; us per call "
             "under CUDA graphs (median of replays, inputs rotated past L2); error: relative L2 "
             "against the torch reference (first input set).", "",
             "| cache | NKV | B | ctx | base us | now us | now / base | error base | error now |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['cache']} | {r['nkv']} | {r['batch']} | {r['ctx']} | {r['skipped']} |||||")
            continue
        lines.append(f"| {r['cache']} | {r['nkv']} | {r['batch']} | {r['ctx']} | {r['base_us']:.1f} | "
                     f"{r['now_us']:.1f} | {r['now_us'] / r['base_us']:.3f} | {r['base_error']:.1e} | "
                     f"{r['now_error']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="directory with the other version's files")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--base-commit", default="unknown")
    parser.add_argument("--budget-s", type=float, default=120.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    base = load_version(args.base)
    device, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    deadline = cab.Deadline(args.budget_s)
    result = {"device": torch.cuda.get_device_name(), "commit": args.commit, "base_commit": args.base_commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__,
              "command": f"python -m bench.bench_context_versions {shlex.join(sys.argv[1:])}",
              "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for cache, nkv, batch, ctx in CASES:
        row = {"cache": cache, "nkv": nkv, "batch": batch, "ctx": ctx}
        if deadline.passed():
            result["rows"].append(dict(row, skipped="time budget"))
            continue
        sets, _ = make_case_sets(cache, nkv, batch, ctx, device, gen)
        row["base_us"], row["base_error"] = time_version(base.paged_context_attention, sets, cache)
        row["now_us"], row["now_error"] = time_version(kernels.paged_context_attention, sets, cache)
        result["rows"].append(row)
        log.info("%s", row)
        del sets
        torch.cuda.empty_cache()
        (args.out / "context_versions.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "context_versions.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
