"""Benchmark of kernels.paged_context_attention on a GPU, under CUDA graphs, against its roofs.

For B x ctx x NKV x dtype (D 128, Q 16, group 4, 32-token pages scattered over a pool arena):
the default path (split-KV or single pass as planned), the single-pass kernel alone, torch SDPA
over the same context already gathered into a dense bf16 buffer (what a dense-buffer design
runs), and the bytes floor (K/V bytes / the device-to-device copy bandwidth measured here).
Each time is one CUDA graph holding one launch per rotated input set (sets rotate through more
than 4x the L2 so every launch reads HBM), divided by the set count, median over replays.
It also shows graph safety (capture once, replay at other lengths, compare with the reference),
that new batch sizes do not recompile, and a small tile sweep.

    python -m bench.bench_context_attention --out DIR [--budget-s 330] [--commit HASH]

Writes DIR/context_attention.{json,md,png} (the report: bench_context_attention_report.py); progress
goes to the log.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from bench.bench_context_attention_report import markdown, plot
from kernels import context_attention as ca
from kernels import context_attention_kernel, split_kv

log = logging.getLogger("bench.bench_context_attention")

NUM_Q, GROUP, HEAD_DIM, TPB = 16, 4, 128, 32
BATCHES, CONTEXTS, KV_HEADS, DTYPES = (1, 4, 16, 64, 256), (2048, 8192, 32768), (4, 8), ("bf16", "fp8")
ROTATE_BYTES, MAX_SETS = 256 << 20, 64
K_SCALE, V_SCALE = 0.5, 2.0
GEOMETRY = dict(num_q=NUM_Q, group=GROUP, head_dim=HEAD_DIM, tpb=TPB)  # for the report
# (batch, dtype, path) -> tile configs tried at ctx 8192, NKV 4; the first of each is the default
TUNE_CONFIGS = {
    "single bf16": [ca.LaunchConfig(64, 4, 5), ca.LaunchConfig(64, 4, 3), ca.LaunchConfig(128, 4, 3)],
    "single fp8": [ca.LaunchConfig(128, 4, 3), ca.LaunchConfig(64, 4, 3), ca.LaunchConfig(128, 4, 4)],
    "split bf16": [ca.LaunchConfig(64, 4, 5), ca.LaunchConfig(64, 4, 3), ca.LaunchConfig(64, 4, 2),
                   ca.LaunchConfig(32, 4, 4), ca.LaunchConfig(64, 4, 3, merge_chunk=16)],
}


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end


def cache_dtype(name: str) -> torch.dtype:
    return torch.float8_e4m3fn if name == "fp8" else torch.bfloat16


def fill_random(t: torch.Tensor) -> torch.Tensor:
    """Random normal values in any dtype (fp8 through bf16 chunks); never zeros, which time faster."""
    flat = t.view(-1)
    for chunk in flat.split(1 << 28):
        chunk.copy_(torch.randn(chunk.numel(), device=t.device, dtype=torch.bfloat16))
    return t


def time_graph(launches, min_reps=10, max_reps=400, budget_s=0.3) -> float:
    """Microseconds per launch: one graph replays every launch once; median over replays."""
    for launch in launches:  # compile and warm outside the capture
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, spent = [], 0.0
    while len(times) < min_reps or (spent < budget_s * 1e3 and len(times) < max_reps):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
        spent += times[-1]
    del graph
    return statistics.median(times) * 1e3 / len(launches)


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = fill_random(torch.empty(1 << 30, dtype=torch.bfloat16, device=device))  # 2 GiB
    dst = torch.empty_like(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(12):
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times[2:])


def make_sets(batch, ctx, nkv, dtype_name, device, gen, ctx_lens=None):
    """Rotated input sets over one pool arena [blocks, 2, TPB, NKV, D] with shuffled pages."""
    pages = -(-ctx // TPB)
    kv_bytes = batch * ctx * nkv * HEAD_DIM * 2 * cache_dtype(dtype_name).itemsize
    num_sets = max(1, min(MAX_SETS, -(-ROTATE_BYTES // kv_bytes)))
    arena = fill_random(torch.empty(num_sets * batch * pages, 2, TPB, nkv, HEAD_DIM,
                                    dtype=cache_dtype(dtype_name), device=device))
    perm = torch.randperm(arena.shape[0], generator=gen).int().to(device)
    lens = torch.full((batch,), ctx, dtype=torch.int32) if ctx_lens is None else ctx_lens
    sets = []
    for s in range(num_sets):
        sets.append({
            "q": torch.randn(batch, NUM_Q, nkv * GROUP, HEAD_DIM, device=device, dtype=torch.bfloat16),
            "k_cache": arena[:, 0], "v_cache": arena[:, 1],
            "block_table": perm[s * batch * pages:(s + 1) * batch * pages].view(batch, pages),
            "ctx_lens": lens.to(device),
            "k_noise": torch.randn(batch, NUM_Q, nkv, HEAD_DIM, device=device, dtype=torch.bfloat16),
            "v_noise": torch.randn(batch, NUM_Q, nkv, HEAD_DIM, device=device, dtype=torch.bfloat16),
        })
    return sets, kv_bytes


def scales(dtype_name):
    return {"k_scale": K_SCALE, "v_scale": V_SCALE} if dtype_name == "fp8" else {}


def time_ours(sets, dtype_name, num_splits=None) -> float:
    outs = [torch.empty_like(s["q"]) for s in sets]
    launches = [lambda s=s, o=o: kernels.paged_context_attention(**s, out=o, num_splits=num_splits,
                                                                  **scales(dtype_name))
                for s, o in zip(sets, outs)]
    return time_graph(launches)


def time_sdpa(batch, ctx, nkv, device):
    """SDPA over a dense bf16 [B, NKV, ctx + Q, D] buffer (context then noise), GQA, no mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dense_bytes = batch * (ctx + NUM_Q) * nkv * HEAD_DIM * 2 * 2
    num_sets = max(1, min(MAX_SETS, -(-ROTATE_BYTES // dense_bytes)))
    sets = [(torch.randn(batch, nkv * GROUP, NUM_Q, HEAD_DIM, device=device, dtype=torch.bfloat16),
             fill_random(torch.empty(batch, nkv, ctx + NUM_Q, HEAD_DIM, device=device, dtype=torch.bfloat16)),
             fill_random(torch.empty(batch, nkv, ctx + NUM_Q, HEAD_DIM, device=device, dtype=torch.bfloat16)))
            for _ in range(num_sets)]
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                launches = [lambda s=s: F.scaled_dot_product_attention(*s, enable_gqa=True) for s in sets]
                return time_graph(launches), backend.name
        except RuntimeError as err:  # backend refuses this shape: try the next
            log.info("SDPA %s refused: %s", backend.name, str(err).splitlines()[0])
    return None, "none"


def sweep(device, copy_bw, deadline, gen):
    rows = []
    for dtype_name in DTYPES:
        for nkv in KV_HEADS:
            for batch in BATCHES:
                for ctx in CONTEXTS:
                    if deadline.passed():
                        rows.append({"dtype": dtype_name, "nkv": nkv, "batch": batch, "ctx": ctx,
                                     "skipped": "time budget"})
                        continue
                    rows.append(measure(device, copy_bw, gen, dtype_name, nkv, batch, ctx))
                    log.info("%s", rows[-1])
                    torch.cuda.empty_cache()
    return rows


def measure(device, copy_bw, gen, dtype_name, nkv, batch, ctx):
    sets, kv_bytes = make_sets(batch, ctx, nkv, dtype_name, device, gen)
    max_splits = split_kv.plan_max_splits(batch * nkv, device)
    ours = time_ours(sets, dtype_name)
    single = ours if max_splits == 1 else time_ours(sets, dtype_name, num_splits=1)
    del sets
    torch.cuda.empty_cache()
    sdpa, sdpa_backend = time_sdpa(batch, ctx, nkv, device)
    return {"dtype": dtype_name, "nkv": nkv, "batch": batch, "ctx": ctx, "grid_splits": max_splits,
            "kv_bytes": kv_bytes, "ours_us": ours, "single_pass_us": single, "sdpa_us": sdpa,
            "sdpa_backend": sdpa_backend, "floor_us": kv_bytes / copy_bw * 1e6,
            "ours_gbps": kv_bytes / ours / 1e3, "ours_pct_copy": 100 * kv_bytes / (ours * 1e-6) / copy_bw}


def relative_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def graph_safety(device, gen):
    """Capture once per path, replay at other lengths, compare with the reference each time."""
    results = []
    for batch, dtype_name in ((4, "bf16"), (4, "fp8"), (64, "bf16")):
        sets, _ = make_sets(batch, 8192, 4, dtype_name, device, gen)
        case = sets[0]
        out = torch.empty_like(case["q"])
        kernels.paged_context_attention(**case, out=out, **scales(dtype_name))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernels.paged_context_attention(**case, out=out, **scales(dtype_name))
        for _ in range(3):
            lens = torch.randint(0, 8193, (batch,), generator=gen).int()
            lens[0] = 0
            case["ctx_lens"].copy_(lens)
            out.fill_(float("nan"))
            graph.replay()
            want = kernels.reference.paged_context_attention(**case, **scales(dtype_name))
            results.append({"batch": batch, "dtype": dtype_name, "lens_head": lens[:4].tolist(),
                            "rel_err": relative_error(out, want), "nan": bool(out.isnan().any())})
        del graph, sets
    return results


def recompile_check(device, gen):
    """Compiled variants of the split kernel before and after batch sizes 1..24 (no growth expected)."""
    jitted = (context_attention_kernel._context_attention_kernel,
              context_attention_kernel._context_merge_kernel)
    counts = []
    for batch in (1, 2, 3, 5, 8, 13, 24):
        sets, _ = make_sets(batch, 2048, 4, "bf16", device, gen)
        kernels.paged_context_attention(**sets[0])
        counts.append(sum(len(c[0]) for k in jitted for c in k.device_caches.values()))
    return counts


def sdpa_agrees(device, gen):
    """Our output equals SDPA over the same context gathered densely plus the noise (sanity)."""
    sets, _ = make_sets(2, 2048, 4, "bf16", device, gen)
    case = sets[0]
    ours = kernels.paged_context_attention(**case)
    pos = torch.arange(2048, device=device)
    dense = [torch.cat([cache[case["block_table"][:, pos // TPB].long(), pos % TPB], case[noise]], dim=1)
             for cache, noise in ((case["k_cache"], "k_noise"), (case["v_cache"], "v_noise"))]
    sdpa = F.scaled_dot_product_attention(case["q"].transpose(1, 2), dense[0].transpose(1, 2),
                                          dense[1].transpose(1, 2), enable_gqa=True).transpose(1, 2)
    return relative_error(ours, sdpa)


def _configured_launch(case, dtype_name, max_splits, min_tokens, config):
    """A launch of the private launcher with an explicit tile config (the public path plans its own)."""
    out = torch.empty_like(case["q"])
    fp8 = dtype_name == "fp8"
    names = ("q", "k_cache", "v_cache", "block_table", "ctx_lens", "k_noise", "v_noise")
    args = [case[name] for name in names]
    return lambda: ca._launch_context_attention(*args, out, HEAD_DIM**-0.5, K_SCALE if fp8 else None,
                                                V_SCALE if fp8 else None, max_splits, min_tokens, config)


def tune(device, gen, deadline):
    """A few tile configs on the single pass (B 64) and the split path (B 1), plus forced splits."""
    rows = []
    for batch, dtype_name, path in ((64, "bf16", "single"), (64, "fp8", "single"), (1, "bf16", "split")):
        sets, kv_bytes = make_sets(batch, 8192, 4, dtype_name, device, gen)
        max_splits = 1 if path == "single" else split_kv.plan_max_splits(batch * 4, device)
        min_tokens = split_kv.min_tokens_per_split(NUM_Q * GROUP)
        for config in TUNE_CONFIGS[f"{path} {dtype_name}"]:
            if deadline.passed():
                break
            launches = [_configured_launch(s, dtype_name, max_splits, min_tokens, config) for s in sets]
            us = time_graph(launches)
            rows.append({"batch": batch, "dtype": dtype_name, "path": path,
                         "config": dataclasses.asdict(config), "us": us, "gbps": kv_bytes / us / 1e3})
            log.info("%s", rows[-1])
        if path == "split":
            for num_splits in (16, 32, 64):
                us = time_ours(sets, dtype_name, num_splits=num_splits)
                rows.append({"batch": batch, "dtype": dtype_name, "path": f"forced {num_splits} splits",
                             "us": us, "gbps": kv_bytes / us / 1e3})
        del sets
        torch.cuda.empty_cache()
    return rows


def environment(device, args) -> dict:
    import triton

    props = torch.cuda.get_device_properties(device)
    return {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "commit": args.commit, "command": args.command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=330.0, help="sweep time budget; later rows skip")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--command", help="the command to record (default: this one's arguments)")
    args = parser.parse_args()
    args.command = args.command or "python -m bench.bench_context_attention " + " ".join(sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = Deadline(args.budget_s)
    result = {"env": environment(device, args), "copy_bw": copy_bandwidth(device)}
    log.info("copy bandwidth %.0f GB/s", result["copy_bw"] / 1e9)
    result["graph_safety"] = graph_safety(device, gen)
    result["recompile_counts"] = recompile_check(device, gen)
    result["sdpa_rel_err"] = sdpa_agrees(device, gen)
    log.info("graph safety %s, recompiles %s, sdpa %s", result["graph_safety"], result["recompile_counts"],
             result["sdpa_rel_err"])
    result["sweep"] = sweep(device, result["copy_bw"], deadline, gen)
    (args.out / "context_attention.json").write_text(json.dumps(result, indent=1))
    result["tune"] = tune(device, gen, Deadline(max(20.0, deadline.end - time.monotonic() + 40)))
    (args.out / "context_attention.json").write_text(json.dumps(result, indent=1))
    report = markdown(result, GEOMETRY)
    (args.out / "context_attention.md").write_text(report)
    plot(result, args.out / "context_attention.png", GEOMETRY)
    print(report)


if __name__ == "__main__":
    main()
