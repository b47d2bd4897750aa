"""A per-resource model of the attention benches' cases: what bounds each one on an H200 (no GPU needed).

    python -m bench.bench_roofline [--paged bench/results/paged_attention.json]
        [--context bench/results/context_attention.json] [--out bench/results/roofline.md]

For every case of the issue targets (decode and verify at B >= 32 and the 8k prefill of the paged
bench; B >= 64 of the context bench) it estimates, from the case's shape and launch tile and the
ceilings measured in the same runs, the time each resource would need alone:

* HBM: the bench's bytes over the copy bandwidth measured in its run (its floor);
* tensor cores: the dots the kernel issues, with padded tile rows and whole key tiles, at the bf16
  matmul rate the paged run measured (e4m3 score dots of 64-row fp8 tiles at twice it, two of them);
* MUFU: one exp2 per (tile row, key);
* conversions: widening fp8 K and V (V only where the score dots take e4m3 keys) and packing P to
  fp16, two values per instruction.

MUFU and conversions issue at 16 per clock per SM on sm_90 (the CUDA guide's throughput table; the
offline sm_90 builds put both on that pipe, `bench/bench_kernel_sass.py`), at the H200's 1.98 GHz SM clock.
Two estimates come out. *In order*: the SM's tensor cores and its 16-per-clock pipe take turns, as
a softmax loop does when every warpgroup waits on its own dots and the CTA's barriers keep warpgroups
in step (Triton 3.6 generates no warp specialisation for this loop on sm_90); loads overlap. *Overlapped*:
every resource busy at once (the largest single part). Both are a model, not a measurement: where a
target lies above the in-order estimate, reaching it needs the dots to overlap the softmax.
Not modelled: shared-memory traffic of widened tiles, the lower rate of mma.sync tiles (under 64
rows), the latency of short programs and of launches; so a case far below its estimates is bound
by one of those.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from bench.bench_context_attention import GEOMETRY as CONTEXT_GEOMETRY

SM_CLOCK_HZ = 1.98e9
SLOW_PIPE_PER_CLOCK = 16  # MUFU.EX2 and F2FP instructions per clock per SM (sm_90)
VALUES_PER_CONVERSION = 2  # F2FP converts a pair
H200_SMS = 132  # the paged results do not record the SM count
FP8_SCORE_DOT_MIN_ROWS = 64  # tiles of >= 64 rows over fp8 dot q's two e4m3 terms (kernels.operands)


@dataclass(frozen=True)
class Work:
    """What one case asks of each resource: bytes, bf16-equivalent dot FLOPs, exp2s, conversions."""

    bytes: float
    dot_flops: float
    exps: float
    conversions: float

    @staticmethod
    def attention(items: float, rows: int, keys: float, head_dim: int, fp8: bool, nbytes: float) -> Work:
        """`items` tiles of `rows` padded rows, each over `keys` keys (whole key tiles)."""
        e4m3_scores = fp8 and rows >= FP8_SCORE_DOT_MIN_ROWS
        pairs = items * rows * keys
        # QK and PV at 2 * rows * D FLOPs per key; e4m3 scores: two dots at twice the rate
        dot_flops = 2 * 2 * pairs * head_dim
        widened = (1 if e4m3_scores else 2) * head_dim * items * keys if fp8 else 0.0
        conversions = (widened + pairs) / VALUES_PER_CONVERSION  # + P packed to fp16
        return Work(nbytes, dot_flops, pairs, conversions)


@dataclass(frozen=True)
class Estimate:
    """Seconds per resource, and the two combined estimates."""

    hbm: float
    tensor: float
    mufu: float
    conversion: float

    @property
    def in_order(self) -> float:
        return max(self.hbm, self.tensor + self.mufu + self.conversion)

    @property
    def overlapped(self) -> float:
        return max(self.hbm, self.tensor, self.mufu + self.conversion)

    @property
    def bound_by(self) -> str:
        return "HBM" if self.hbm >= self.tensor + self.mufu + self.conversion else "compute in order"


def estimate(work: Work, copy_bytes_per_s: float, matmul_flop_per_s: float, sms: int) -> Estimate:
    slow_pipe = SLOW_PIPE_PER_CLOCK * sms * SM_CLOCK_HZ
    return Estimate(work.bytes / copy_bytes_per_s, work.dot_flops / matmul_flop_per_s,
                    work.exps / slow_pipe, work.conversions / slow_pipe)


def paged_work(case: dict, geometry: dict) -> Work:
    """Tiles of `case["tiles"]` over a batch of equal sequences (seq_len = ctx, q_len queries each);
    `geometry`: the paged run's (its JSON's meta)."""
    tiles, ctx, q_len = case["tiles"], case["ctx"], case["q_len"]
    block_q, block_n = tiles["block_q"], tiles["block_n"]
    keys = 0.0
    for tile in range(math.ceil(q_len / block_q)):  # causal: tile t sees keys up to its last query
        visible = ctx - q_len + min((tile + 1) * block_q, q_len)
        keys += math.ceil(visible / block_n) * block_n
    items = case["batch"] * geometry["kv_heads"]
    return Work.attention(items, tiles["block_m"], keys, geometry["head_dim"], case["dtype"] == "fp8",
                          case["bytes"])


def context_work(row: dict, geometry: dict = CONTEXT_GEOMETRY) -> Work:
    """Q x group rows per (request, KV head) over the context and the Q noise keys (64-key tiles)."""
    rows = max(16, geometry["num_q"] * geometry["group"])
    keys = math.ceil(row["ctx"] / 64) * 64 + geometry["num_q"]
    return Work.attention(row["batch"] * row["nkv"], rows, keys, geometry["head_dim"], row["dtype"] == "fp8",
                          row["kv_bytes"])


def paged_rows(paged: dict) -> list[tuple[str, float, Estimate, bool]]:
    """(case, measured s, estimate, is a prefill) for the paged targets."""
    ceilings = paged["ceilings"]
    rows = []
    for case in paged["cases"]:
        prefill = case["q_len"] > 16
        if not prefill and case["batch"] < 32:
            continue
        est = estimate(paged_work(case, paged["meta"]["geometry"]), ceilings["copy_bytes_per_s"],
                       ceilings["matmul_flop_per_s"], H200_SMS)
        name = f"paged {case['dtype']} q{case['q_len']} B{case['batch']} ctx{case['ctx']}"
        rows.append((name, case["seconds"], est, prefill))
    return rows


def context_rows(context: dict, matmul_flop_per_s: float) -> list[tuple[str, float, Estimate, bool]]:
    sms = context["env"].get("sms", H200_SMS)
    rows = []
    for row in context["sweep"]:
        if row["batch"] < 64:
            continue
        est = estimate(context_work(row), context["copy_bw"], matmul_flop_per_s, sms)
        name = f"context {row['dtype']} NKV{row['nkv']} B{row['batch']} ctx{row['ctx']}"
        rows.append((name, row["ours_us"] * 1e-6, est, False))
    return rows


def markdown(rows, paged: dict, context: dict) -> str:
    ceilings = paged["ceilings"]
    lines = [
        "# Attention cases against a per-resource model (H200)",
        "",
        "Generated by `python -m bench.bench_roofline` from `paged_attention.json` (commit "
        f"`{paged['meta'].get('commit', '?')[:7]}`) and `context_attention.json` (commit "
        f"`{context['env'].get('commit', '?')[:7]}`); the model and its constants are in the script's "
        f"docstring. Ceilings of those runs: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (paged), "
        f"{context['copy_bw'] / 1e12:.2f} TB/s (context); bf16 matmul "
        f"{ceilings['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s (paged run, used for both).",
        "",
        "Rates: decode, verify and context as % of the copy bandwidth (the bytes floor over the time), the "
        "prefill as % of the time the dots alone would take at the matmul rate. `in order` and `overlapped` "
        "are the rates the two estimates allow; `measured / in order` how much of the in-order estimate the "
        "kernel reaches.",
        "",
        "| case | measured us | HBM us | dots us | exp2 us | conversions us | in order us | measured % | "
        "in order % | overlapped % | measured / in order | bound (in order) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, seconds, est, prefill in rows:
        floor = est.tensor if prefill else est.hbm
        lines.append(
            f"| {name} | {seconds * 1e6:.1f} | {est.hbm * 1e6:.1f} | {est.tensor * 1e6:.1f} | "
            f"{est.mufu * 1e6:.1f} | {est.conversion * 1e6:.1f} | {est.in_order * 1e6:.1f} | "
            f"{100 * floor / seconds:.0f} | {100 * floor / est.in_order:.0f} | "
            f"{100 * floor / est.overlapped:.0f} | {est.in_order / seconds:.2f} | {est.bound_by} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paged", type=Path, default=Path("bench/results/paged_attention.json"))
    parser.add_argument("--context", type=Path, default=Path("bench/results/context_attention.json"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/roofline.md"))
    args = parser.parse_args()
    paged = json.loads(args.paged.read_text())
    context = json.loads(args.context.read_text())
    rows = paged_rows(paged) + context_rows(context, paged["ceilings"]["matmul_flop_per_s"])
    args.out.write_text(markdown(rows, paged, context))
    print(args.out)


if __name__ == "__main__":
    main()
