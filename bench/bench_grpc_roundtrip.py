"""Round trip of one scheduler step over the gRPC control plane: batched Reserve + Commit of 256 sequences.

The pool server runs in its own process (as `dflash kvpool` would), the client in this one, over
loopback. Beside it: the same step on an in-process BlockManager (what the split costs) and the
smallest call, PoolStats (the transport's floor).

    .venv/bin/python -m bench.bench_grpc_roundtrip --out bench/results/grpc_roundtrip_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import random
import subprocess
import sys
import time
from pathlib import Path

from bench.bench_blocks import machine, percentile, publish
from kvpool_service.block_manager import BlockManager
from kvpool_service.client import KVPoolClient
from kvpool_service.control import CommitRequest, OpenRequest, ReserveRequest
from kvpool_service.geometry import LayerGroup, PoolLayout, PoolSpec


def make_pool(args) -> tuple[BlockManager, PoolLayout]:
    # Qwen3-8B-shaped target and DFlash drafter; only the block count matters to the control plane.
    target = LayerGroup(name="target", num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    draft = LayerGroup(name="draft", num_layers=5, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    spec = PoolSpec(target=target, draft=draft, tokens_per_block=args.tokens_per_block)
    k = args.num_speculative_tokens
    max_len = args.prompt_len + args.steps * (k + 1) + k + 1
    layout = PoolLayout.create(spec, args.seqs * -(-max_len // args.tokens_per_block))
    return BlockManager.from_layout(layout, max_num_seqs=args.seqs, max_model_len=max_len), layout


def serve(args, port_pipe) -> None:
    """The server process: one pool, until the parent terminates it."""
    from kvpool_service.server import BackgroundServer

    blocks, layout = make_pool(args)
    server = BackgroundServer(blocks, layout).start()
    port_pipe.send(server.address)
    while True:
        time.sleep(3600)


def run_steps(pool, args, rng: random.Random) -> dict[str, list[float]]:
    k, n = args.num_speculative_tokens, args.seqs
    pool.open([OpenRequest(i, [rng.randrange(150_000) for _ in range(args.prompt_len)]) for i in range(n)])
    pool.commit([CommitRequest(i, args.prompt_len, args.prompt_len) for i in range(n)])
    lens, times = [args.prompt_len] * n, {"reserve": [], "commit": [], "reserve + commit": []}
    for _ in range(args.steps):
        accepted = [rng.randint(1, k + 1) for _ in range(n)]
        reserves = [ReserveRequest(i, lens[i] + k + 1) for i in range(n)]
        commits = [CommitRequest(i, lens[i] + a, lens[i] + a, [rng.randrange(150_000) for _ in range(a)])
                   for i, a in enumerate(accepted)]
        t0 = time.perf_counter_ns()
        pool.reserve(reserves)
        t1 = time.perf_counter_ns()
        pool.commit(commits)
        t2 = time.perf_counter_ns()
        times["reserve"].append((t1 - t0) / 1e3)
        times["commit"].append((t2 - t1) / 1e3)
        times["reserve + commit"].append((t2 - t0) / 1e3)
        lens = [length + a for length, a in zip(lens, accepted)]
    pool.close(list(range(n)))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--num-speculative-tokens", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    local = run_steps(make_pool(args)[0], args, random.Random(0))
    context = mp.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    server = context.Process(target=serve, args=(args, sender), daemon=True)
    server.start()
    try:
        address = receiver.recv()
        with KVPoolClient(address, timeout=10) as client:
            for _ in range(20):  # warm the channel
                client.stats()
            floor = []
            for _ in range(500):
                t0 = time.perf_counter_ns()
                client.stats()
                floor.append((time.perf_counter_ns() - t0) / 1e3)
            remote = run_steps(client, args, random.Random(0))
    finally:
        server.terminate()
        server.join(10)

    rows = [("in-process BlockManager: reserve + commit", local["reserve + commit"]),
            ("gRPC floor: PoolStats round trip", floor)]
    rows += [(f"gRPC: {name}", values) for name, values in remote.items()]
    table = ["| call | p50 (us) | p99 (us) |", "| --- | ---: | ---: |"]
    table += [f"| {name} | {percentile(v, 0.5):.0f} | {percentile(v, 0.99):.0f} |" for name, v in rows]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    report = "\n".join([
        "# gRPC control plane: one batched Reserve + Commit round trip", "",
        f"- machine: {machine()}",
        f"- command: `python -m bench.bench_grpc_roundtrip {' '.join(sys.argv[1:])}`",
        f"- commit: {commit}", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- shape: {args.seqs} sequences, prompt {args.prompt_len}, "
        f"tokens_per_block {args.tokens_per_block}, K = {args.num_speculative_tokens}, {args.steps} steps; "
        "server in its own process on 127.0.0.1, "
        "no auth; each step reserves len + K + 1 and commits 1..K+1 accepted tokens with their ids", "",
        *table, "",
    ])
    return publish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
