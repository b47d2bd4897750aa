"""Benchmark of kernels.paged_attention on a GPU, under CUDA graphs, against its floors and SDPA.

Qwen3-8B attention geometry (32 query heads, 8 KV heads, D 128), 16-token pages shuffled over a
pool arena [num_blocks, 2, tpb, NKV, D]. Decode and verify (q_len 1, 8, 16) for every
B x ctx, bf16 and fp8 caches, and one 8k-token prefill. Beside each kernel time: torch SDPA
over the same K/V already gathered into dense bf16 (what a dense design runs; fp8 rows share the
bf16 SDPA time), the bytes floor (bytes / device-to-device copy bandwidth) and the FLOPs floor
(causal FLOPs / bf16 matmul throughput), both ceilings measured in the same run.

Each time is one CUDA graph holding one launch per rotated input set (sets rotate through more
than 4x the L2, so every launch reads HBM), divided by the set count, median over replays. A
short tile sweep on three representative shapes runs first (unless --no-sweep); the table uses
its winners. The copy ceiling is the fastest of an eager copy and an SM copy kernel in a graph:
a copy captured in a graph becomes a memcpy node, which ran at ~2.7 TB/s on the H200 here.

    python -m bench.bench_paged_attention --out DIR [--commit HASH] [--budget-s 300]
    python -m bench.bench_paged_attention --plot DIR/paged_attention.json   # redraw PNG + md
    python -m bench.bench_paged_attention --smoke --out DIR   # tiny, CPU interpreter ok

Writes DIR/paged_attention.{json,md,png}; progress goes to the log.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton
from torch.nn.attention.bias import causal_lower_right

from bench.bench_paged_attention_report import annotate, markdown, plot, summary
from kernels.paged_attention import _launch_paged_attention
from kernels.paged_tiles import TileConfig, choose_tiles, default_tiles

log = logging.getLogger("bench.bench_paged_attention")

FULL = dict(heads=32, kv_heads=8, head_dim=128, tpb=16, batches=(1, 8, 32, 128, 256),
            contexts=(2048, 8192, 32768), q_lens=(1, 8, 16), prefill=8192)
SMOKE = dict(heads=4, kv_heads=2, head_dim=32, tpb=16, batches=(1, 2), contexts=(40, 70),
             q_lens=(1, 4), prefill=48)
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
ROTATE_BYTES, MAX_SETS = 256 << 20, 32
K_SCALE, V_SCALE = 0.5, 2.0
# (block_n, num_warps, num_stages) tried on the representative shapes; block_m from choose_tiles
SMALL_SWEEP = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 4, 4), (256, 4, 2), (256, 8, 2)]
PREFILL_SWEEP = [(256, 64, 8, 3), (256, 64, 8, 2), (256, 32, 8, 3), (256, 64, 16, 3), (128, 128, 8, 3),
                 (128, 64, 8, 3)]
# (block_m, block_n, num_warps, num_stages); the first run's sweep (bench/results) ruled out 64-row
# prefill tiles and 32-key tiles of 128 rows. 256 x 32 and 16 warps: the adopted 256 x 64 tile spills
# registers on 8 warps (bench/bench_kernel_sass.py), these do not or less.


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end


def time_calls(calls, device) -> float:
    """Seconds per call: one graph of all calls (warmed first), median of replays; CPU: wall clock."""
    for call in calls[:1]:
        call()
    if device.type != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) / len(calls)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    del graph
    return ms * 1e-3 / len(calls)


def ceilings(device, smoke: bool) -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and bf16 matmul FLOP/s, random data.

    The clocks idle low (345 MHz seen): a second of matmuls first, so the ceilings are not
    measured while they ramp (the first run here read 2.77 TB/s for the copy that way).
    """
    n, size = (1 << 20, 256) if smoke else (1 << 30, 8192)
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    warm_until = time.monotonic() + (0.0 if smoke else 1.0)
    while time.monotonic() < warm_until:
        for _ in range(50):
            a @ b
        torch.cuda.synchronize()
    # A copy captured in a graph becomes a memcpy node, which ran at ~2.7 TB/s here (a copy engine,
    # by the look of it); the same copy launched eagerly, and an SM kernel that copies (x * 1) in a
    # graph, are what a kernel can reach. The fastest of the three is the ceiling.
    copies = dict(graph_memcpy=time_calls([lambda: dst.copy_(src)], device),
                  graph_kernel=time_calls([lambda: torch.mul(src, 1, out=dst)], device))
    if device.type == "cuda":
        copies["eager_memcpy"] = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3
    mm_s = time_calls([lambda: a @ b], device)
    result = dict(copy_bytes_per_s=2 * src.nbytes / min(copies.values()),
                  matmul_flop_per_s=2 * size**3 / mm_s,
                  copy_tb_per_s={k: round(2 * src.nbytes / v / 1e12, 3) for k, v in copies.items()})
    log.info("ceilings: copy %.2f TB/s (%s), bf16 matmul %.0f TFLOP/s", result["copy_bytes_per_s"] / 1e12,
             result["copy_tb_per_s"], result["matmul_flop_per_s"] / 1e12)
    return result


class Pool:
    """One layer's pages, K and V of a page side by side, page order shuffled."""

    def __init__(self, geo, num_tokens, dtype, device):
        tpb = geo["tpb"]
        self.num_blocks = triton.cdiv(num_tokens, tpb)
        self.arena = torch.empty(self.num_blocks, 2, tpb, geo["kv_heads"], geo["head_dim"], dtype=dtype,
                                 device=device)
        for chunk in self.arena.view(-1).split(1 << 28):  # never zeros: they time faster
            chunk.copy_(torch.randn(chunk.shape, device=device, dtype=torch.bfloat16))
        self.k, self.v = self.arena[:, 0], self.arena[:, 1]
        self.perm = torch.randperm(self.num_blocks, device=device).int()

    def tables(self, batch, pages, count):
        """`count` disjoint block tables [batch, pages] over shuffled pages."""
        per_set = batch * pages
        return [self.perm[r * per_set:(r + 1) * per_set].view(batch, pages) for r in range(count)]

    def dense(self, table, ctx):
        """K, V of the table's sequences as dense bf16 [B, NKV, ctx, D], dequantized."""
        scales = (K_SCALE, V_SCALE) if self.k.dtype == torch.float8_e4m3fn else (1.0, 1.0)
        dense = []
        for cache, s in zip((self.k, self.v), scales):  # one copy at a time: B 256 x ctx 32k is 17 GB
            t = cache[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).to(torch.bfloat16).contiguous()
            dense.append(t.mul_(s) if s != 1.0 else t)
        return dense


def causal_flops(geo, batch, ctx, q_len) -> float:
    """4 * NH * D per visible (query, key) pair: query i of a block sees ctx - q_len + i + 1 keys."""
    pairs = batch * (q_len * (ctx - q_len) + q_len * (q_len + 1) // 2)
    return 4 * geo["heads"] * geo["head_dim"] * pairs


def sdpa_call(q, k, v, q_len, ctx):
    """SDPA over dense K/V, GQA in the kernel, bottom-right causal when q_len > 1."""
    mask = None if q_len == 1 else causal_lower_right(q_len, ctx)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def run_case(geo, pool, dtype_name, batch, ctx, q_len, tiles, device, sdpa_cache, check=True,
             baseline=True, num_splits=None) -> dict:
    """Time the kernel on rotated tables; time SDPA once per shape (bf16); check against it."""
    heads, head_dim, tpb = geo["heads"], geo["head_dim"], geo["tpb"]
    pages = triton.cdiv(ctx, tpb)
    kv_bytes = batch * ctx * geo["kv_heads"] * head_dim * 2 * pool.arena.element_size()
    sets = max(1, min(MAX_SETS, triton.cdiv(ROTATE_BYTES, kv_bytes), pool.num_blocks // (batch * pages)))
    tables = pool.tables(batch, pages, sets)
    q = torch.randn(batch * q_len, heads, head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    starts = (torch.arange(batch + 1, device=device) * q_len).int()
    scales = dict(k_scale=None, v_scale=None)
    if dtype_name == "fp8":
        scales = dict(k_scale=torch.tensor(K_SCALE, device=device),
                      v_scale=torch.tensor(V_SCALE, device=device))
    launch = functools.partial(_launch_paged_attention, q, pool.k, pool.v, seq_lens=seq_lens,
                               query_start_loc=starts, scale=None, num_splits=num_splits, out=out,
                               tiles=tiles, **scales)
    seconds = time_calls([functools.partial(launch, block_table=t) for t in tables], device)
    record = dict(dtype=dtype_name, batch=batch, ctx=ctx, q_len=q_len, sets=sets, tiles=tiles._asdict(),
                  seconds=seconds, bytes=kv_bytes + 2 * q.nbytes, flops=causal_flops(geo, batch, ctx, q_len))
    key = (batch, ctx, q_len)
    time_sdpa = baseline and key not in sdpa_cache and dtype_name == "bf16"
    if check or time_sdpa:
        dense = [pool.dense(t, ctx) for t in (tables if time_sdpa else tables[:1])]
        qd = q.view(batch, q_len, heads, head_dim).transpose(1, 2)
        try:  # SDPA may pick a backend that does not fit (math with expanded heads): record, go on
            if time_sdpa:
                sdpa_cache[key] = time_calls([sdpa_call(qd, k, v, q_len, ctx) for k, v in dense], device)
            if check:
                launch(block_table=tables[0])
                expected = sdpa_call(qd, *dense[0], q_len, ctx)().transpose(1, 2).reshape(out.shape)
                err = (out.float() - expected.float()).norm() / expected.float().norm()
                record["rel_err_vs_sdpa"] = err.item()
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            record["sdpa_error"] = repr(exc)[:300]
            log.warning("SDPA failed at B%d ctx%d q%d: %r", batch, ctx, q_len, exc)
        del dense
    record["sdpa_seconds"] = sdpa_cache.get(key)
    return record


def sweep_shapes(geo) -> dict:
    """Representative (B, ctx, q_len) per regime: B 32 at the middle context, and the prefill."""
    batch, ctx = (2 if geo is SMOKE else 32), geo["contexts"][1]
    return {"decode": (batch, ctx, 1), "verify": (batch, ctx, geo["q_lens"][-1]),
            "prefill": (1, geo["prefill"], geo["prefill"])}


def candidates(regime, base, group) -> list[TileConfig]:
    if regime == "prefill":
        return [base._replace(block_q=m // group, block_m=m, block_n=n, num_warps=w, num_stages=s)
                for m, n, w, s in PREFILL_SWEEP]
    return [base._replace(block_n=n, num_warps=w, num_stages=s) for n, w, s in SMALL_SWEEP]


def sweep(geo, pools, device, deadline) -> tuple[dict, dict]:
    """Time each candidate tile per (regime, cache dtype) on its representative shape; keep the best."""
    best, rows = {}, []
    group = geo["heads"] // geo["kv_heads"]
    for dtype_name, pool in pools.items():
        for regime, (batch, ctx, q_len) in sweep_shapes(geo).items():
            base = choose_tiles(batch * q_len, batch, group, geo["head_dim"], device, DTYPES[dtype_name])
            for tiles in candidates(regime, base, group) if device.type == "cuda" else [base]:
                if deadline.passed():
                    break
                row = dict(regime=regime, dtype=dtype_name, tiles=tiles._asdict())
                try:
                    rec = run_case(geo, pool, dtype_name, batch, ctx, q_len, tiles, device, {}, check=False,
                                   baseline=False)
                    row["seconds"] = rec["seconds"]
                    log.info("sweep %s %s %s: %.1f us", dtype_name, regime, tuple(tiles),
                             row["seconds"] * 1e6)
                except Exception as exc:  # a tile that does not fit (shared memory, registers) is skipped
                    row["error"] = repr(exc)[:300]
                    log.warning("sweep %s %s %s failed: %r", dtype_name, regime, tuple(tiles), exc)
                rows.append(row)
            timed = [r for r in rows if (r["regime"], r["dtype"]) == (regime, dtype_name) and "seconds" in r]
            winner = TileConfig(**min(timed, key=lambda r: r["seconds"])["tiles"]) if timed else base
            best[regime, dtype_name] = winner
    summary = {f"{regime} {dtype}": tiles._asdict() for (regime, dtype), tiles in best.items()}
    return dict(best=summary, rows=rows), best


def split_sweep(geo, pools, best, device, deadline) -> list[dict]:
    """The planned split count (None) against forced ones on small batches of long sequences."""
    rows = []
    one, few = (geo["batches"] * 2)[:2]  # one batch size given: both are it
    ctxs, q_len_max = geo["contexts"], geo["q_lens"][-1]
    for batch, ctx, q_len in ((one, ctxs[1], 1), (few, ctxs[1], 1), (one, ctxs[-1], q_len_max),
                              (few, ctxs[0], q_len_max)):
        for num_splits in (None, 1, 4, 16, 64):
            if deadline.passed():
                continue
            tiles = tiles_for(best, geo, batch, q_len, device, "bf16")
            rec = run_case(geo, pools["bf16"], "bf16", batch, ctx, q_len, tiles, device, {}, check=False,
                           baseline=False, num_splits=num_splits)
            rows.append(dict(batch=batch, ctx=ctx, q_len=q_len, num_splits=num_splits,
                             seconds=rec["seconds"]))
            log.info("splits B%d ctx%d q%d %s: %.1f us", batch, ctx, q_len, num_splits, rec["seconds"] * 1e6)
    return rows


def tiles_for(best, geo, batch, q_len, device, dtype_name) -> TileConfig:
    group = geo["heads"] // geo["kv_heads"]
    if best is None:  # the public path's own tiles
        return default_tiles(batch * q_len, batch, geo["heads"], geo["kv_heads"], geo["head_dim"], device,
                             DTYPES[dtype_name])
    base = choose_tiles(batch * q_len, batch, group, geo["head_dim"], device, DTYPES[dtype_name])
    if base.block_m >= 128 or q_len > 16:
        return best["prefill", dtype_name]
    tuned = best["decode" if q_len == 1 else "verify", dtype_name]
    return base._replace(block_n=tuned.block_n, num_warps=tuned.num_warps, num_stages=tuned.num_stages)


def run_all(geo, device, deadline, do_sweep=True) -> dict:
    tpb = geo["tpb"]
    most_tokens = max(b * triton.cdiv(c, tpb) * tpb for b in geo["batches"]
                      for c in (*geo["contexts"], geo["prefill"]))
    pools = {name: Pool(geo, most_tokens, dtype, device) for name, dtype in DTYPES.items()}
    sweep_result, best = sweep(geo, pools, device, deadline) if do_sweep else (dict(rows=[]), None)
    cases, sdpa_cache = [], {}
    for dtype_name in DTYPES:
        for q_len in geo["q_lens"]:
            for batch in geo["batches"]:
                for ctx in geo["contexts"]:
                    if deadline.passed():
                        log.warning("budget spent: skipping %s q%d B%d ctx%d", dtype_name, q_len, batch, ctx)
                        continue
                    tiles = tiles_for(best, geo, batch, q_len, device, dtype_name)
                    rec = run_case(geo, pools[dtype_name], dtype_name, batch, ctx, q_len, tiles, device,
                                   sdpa_cache, check=batch * ctx <= (1 << 20))
                    cases.append(rec)
                    log.info("%s q%d B%d ctx%d: %.1f us (sdpa %s)", dtype_name, q_len, batch, ctx,
                             rec["seconds"] * 1e6, f"{rec['sdpa_seconds'] * 1e6:.1f} us"
                             if rec["sdpa_seconds"] else "-")
        prefill = geo["prefill"]
        cases.append(run_case(geo, pools[dtype_name], dtype_name, 1, prefill, prefill,
                              tiles_for(best, geo, 1, prefill, device, dtype_name), device, sdpa_cache))
        cases[-1]["kind"] = "prefill"
    sweep_result["splits"] = split_sweep(geo, pools, best, device, deadline)
    return dict(sweep=sweep_result, cases=cases)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cases after this")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU through the interpreter)")
    parser.add_argument("--plot", type=Path, help="only redraw the PNG and markdown from this JSON")
    parser.add_argument("--no-sweep", action="store_true", help="use choose_tiles' defaults, no tile sweep")
    parser.add_argument("--batches", type=int, nargs="+", help="only these batch sizes (default: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.plot:
        result = json.loads(args.plot.read_text())
        args.plot.with_suffix(".md").write_text(markdown(result))
        plot(result, args.plot.with_suffix(".png"))
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    deadline = Deadline(args.budget_s)
    geo = SMOKE if args.smoke else FULL
    if args.batches:
        geo = {**geo, "batches": tuple(args.batches)}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    result = dict(meta=dict(device=name, commit=args.commit, date=now,
                            torch=torch.__version__, triton=triton.__version__,
                            command="python -m bench.bench_paged_attention " + " ".join(sys.argv[1:]),
                            geometry=geo))
    first = ceilings(device, args.smoke)
    result.update(run_all(geo, device, deadline, do_sweep=not args.no_sweep))
    last = ceilings(device, args.smoke)  # again, warm: the higher of the two is the ceiling
    result["ceilings"] = {k: max(first[k], last[k]) for k in ("copy_bytes_per_s", "matmul_flop_per_s")}
    result["ceilings"] |= dict(first=first, last=last)
    annotate(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paged_attention.json").write_text(json.dumps(result, indent=1))
    (args.out / "paged_attention.md").write_text(markdown(result))
    log.info("\n%s", "\n".join(summary(result)))
    try:
        plot(result, args.out / "paged_attention.png")
    except ImportError as exc:
        log.warning("no PNG (%s): redraw with --plot", exc)


if __name__ == "__main__":
    main()
