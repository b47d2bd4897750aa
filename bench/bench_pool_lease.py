"""Time a scheduler step spends blocked on the pool's gRPC control plane, with and without leases.

The pool server runs in its own process (as `dflash kvpool` would), the client in this one, over
loopback. Each step does what the scheduler does: reserve every sequence to num_computed + K + 1,
run the forward (a sleep of --forward-ms: the GIL is free, as while the GPU computes), accept
1..K+1 tokens, commit them with their ids. Three clients of the same pool:
  - exact: the bare KVPoolClient, every call a blocking RPC (what the target does today);
  - queued: LeasedPoolControl with lease_tokens 0 (commits queued; reserves exact, so one RPC
    whenever a sequence's last block is full);
  - leased: LeasedPoolControl with --lease-tokens.
Per step: time blocked in pool calls (median, p90), blocking RPCs, the share of steps with none,
and payload bytes of every RPC (queued ones too). The floor beside it is one PoolStats round trip:
what each blocking RPC costs at least.

    .venv/bin/python -m bench.bench_pool_lease --out bench/results/pool_lease_cpu.md
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
from kvpool_service.control import CommitRequest, OpenRequest, ReserveRequest
from kvpool_service.geometry import LayerGroup, PoolLayout, PoolSpec
from kvpool_service.leased_control import LeasedPoolControl
from kvpool_service.metered_client import MeteredKVPoolClient, tensor_fields

MODES = ("exact", "queued", "leased")


def max_len(args) -> int:
    k = args.num_speculative_tokens
    return args.prompt_len + args.steps * (k + 1) + k + 1 + args.lease_tokens


def serve(args, pipe) -> None:
    """The server process: one pool with room for the largest batch, until terminated."""
    from kvpool_service.server import BackgroundServer

    # Qwen3-8B-shaped target and DFlash drafter; only the block count matters to the control plane.
    target = LayerGroup(name="target", num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    draft = LayerGroup(name="draft", num_layers=5, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    spec = PoolSpec(target=target, draft=draft, tokens_per_block=args.tokens_per_block)
    seqs = max(args.batch_sizes)
    layout = PoolLayout.create(spec, seqs * -(-max_len(args) // args.tokens_per_block))
    blocks = BlockManager.from_layout(layout, max_num_seqs=seqs, max_model_len=max_len(args))
    server = BackgroundServer(blocks, layout).start()
    pipe.send(server.address)
    while True:
        time.sleep(3600)


def run_steps(pool, client: MeteredKVPoolClient, args, batch: int, first_id: int, rng: random.Random):
    """Blocked microseconds and blocking RPCs per step, and the traffic of the timed steps."""
    k, ids = args.num_speculative_tokens, range(first_id, first_id + batch)
    pool.open([OpenRequest(i, [rng.randrange(150_000) for _ in range(args.prompt_len)]) for i in ids])
    pool.commit([CommitRequest(i, args.prompt_len, args.prompt_len) for i in ids])
    computed = dict.fromkeys(ids, args.prompt_len)
    leased = pool if isinstance(pool, LeasedPoolControl) else None
    if leased:
        leased.flush()
    client.traffic.reset()
    blocked_us, blocking_rpcs = [], []
    for _ in range(args.steps):
        before = leased.lease_stats.blocking_rpcs if leased else 0
        t0 = time.perf_counter_ns()
        pool.reserve([ReserveRequest(i, computed[i] + k + 1) for i in ids])
        t1 = time.perf_counter_ns()
        time.sleep(args.forward_ms / 1e3)
        commits = []
        for i in ids:
            accepted = rng.randint(1, k + 1)
            commits.append(CommitRequest(i, computed[i] + accepted, computed[i] + accepted,
                                         [rng.randrange(150_000) for _ in range(accepted)]))
            computed[i] += accepted
        t2 = time.perf_counter_ns()
        pool.commit(commits)
        t3 = time.perf_counter_ns()
        blocked_us.append((t1 - t0 + t3 - t2) / 1e3)
        blocking_rpcs.append(leased.lease_stats.blocking_rpcs - before if leased else 2)
    if leased:
        leased.flush()  # the queued commits' bytes belong to these steps
    traffic = client.traffic.snapshot()
    pool.close(list(ids))
    if leased:
        leased.flush()
    return blocked_us, blocking_rpcs, traffic


def measure(address: str, args) -> tuple[list[tuple], float]:
    rows, first_id, rng = [], 0, random.Random(0)
    with MeteredKVPoolClient(address, timeout=10) as client:
        for _ in range(20):  # warm the channel
            client.stats()
        floor = []
        for _ in range(300):
            t0 = time.perf_counter_ns()
            client.stats()
            floor.append((time.perf_counter_ns() - t0) / 1e3)
        for forward_ms in args.forward_ms:
            args.forward_ms = forward_ms
            for batch in args.batch_sizes:
                for mode in MODES:
                    lease = args.lease_tokens if mode == "leased" else 0
                    pool = client if mode == "exact" else LeasedPoolControl(client, lease_tokens=lease)
                    blocked, rpcs, traffic = run_steps(pool, client, args, batch, first_id, rng)
                    if pool is not client:
                        pool.shutdown()
                    first_id += batch
                    rows.append((forward_ms, batch, mode, blocked, rpcs, traffic))
    return rows, percentile(floor, 0.5)


def table(rows: list[tuple], steps: int) -> list[str]:
    lines = ["| forward | B | client | blocked p50 (us) | blocked p90 (us) | blocking RPCs / step | "
             "steps with none | RPCs / step (all) | request B / step | response B / step |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for forward_ms, batch, mode, blocked, rpcs, traffic in rows:
        calls = sum(t.calls for t in traffic.values()) / steps
        request = sum(t.request_bytes for t in traffic.values()) / steps
        response = sum(t.response_bytes for t in traffic.values()) / steps
        none = sum(r == 0 for r in rpcs) / len(rpcs)
        lines.append(f"| {forward_ms:g} ms | {batch} | {mode} | {percentile(blocked, 0.5):.0f} | "
                     f"{percentile(blocked, 0.9):.0f} | {sum(rpcs) / len(rpcs):.2f} | {none:.0%} | "
                     f"{calls:.2f} | {request:.0f} | {response:.0f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--forward-ms", type=float, nargs="+", default=[0.0, 5.0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--num-speculative-tokens", type=int, default=15)
    parser.add_argument("--lease-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    forward_list = list(args.forward_ms)

    context = mp.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    server = context.Process(target=serve, args=(args, sender), daemon=True)
    server.start()
    try:
        rows, floor_us = measure(receiver.recv(), args)
    finally:
        server.terminate()
        server.join(10)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    leak = tensor_fields()
    report = "\n".join([
        "# Pool control plane per step: blocked time with and without leases", "",
        f"- machine: {machine()}",
        f"- command: `python -m bench.bench_pool_lease {' '.join(sys.argv[1:])}`",
        f"- commit: {commit}", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- shape: prompt {args.prompt_len}, tokens_per_block {args.tokens_per_block}, "
        f"K = {args.num_speculative_tokens}, {args.steps} steps per row, lease {args.lease_tokens} tokens; "
        "server in its own process on 127.0.0.1, no auth; each step reserves num_computed + K + 1, "
        "sleeps the forward, commits 1..K+1 accepted tokens with their ids",
        f"- floor: one blocking RPC (PoolStats round trip) takes {floor_us:.0f} us (p50)",
        "- bytes: serialized protobuf payload of every RPC of the timed steps (queued commits included), "
        "request and response; gRPC framing (5 B a message) and HTTP/2 headers come on top",
        f"- fields of kvpool.proto able to carry tensor data (bytes, repeated float/double): "
        f"{', '.join(leak) if leak else 'none'}; so every byte counted is an id or a length", "",
        *table(rows, args.steps), "",
        "forward: the sleep standing in for the step's device work "
        f"({', '.join(f'{f:g}' for f in forward_list)} ms). blocked: wall time inside reserve + commit "
        "per step. exact makes 2 blocking RPCs a step. queued reserves exactly (no RPC while every "
        "sequence's last block has room) but must first wait for the commit queued at the end of the "
        "step before; leased calls only when some sequence runs out of its lease.", "",
    ])
    return publish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
