"""Time one scheduler step of BlockManager bookkeeping: batched reserve + commit for a full batch.

Decode-shaped steps: every sequence reserves room for its bonus token plus K drafts, then commits
the accepted count plus one, with the new token ids (so full blocks are hashed and cached). The
floor printed beside it is a bare Python loop that touches each sequence once (a dict lookup and two
attribute writes): the least any per-sequence Python bookkeeping can cost.

    .venv/bin/python -m bench.bench_blocks --out bench/results/blocks_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvpool_service.block_manager import BlockManager, CommitRequest, OpenRequest, ReserveRequest


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_round(args, rng: random.Random) -> tuple[list[float], list[float], list[float]]:
    tpb, k = args.tokens_per_block, args.num_speculative_tokens
    max_len = args.prompt_len + args.steps * (k + 1) + k + 1
    bm = BlockManager(args.seqs * -(-max_len // tpb), tpb, max_num_seqs=args.seqs, max_model_len=max_len)
    prompts = [[rng.randrange(150_000) for _ in range(args.prompt_len)] for _ in range(args.seqs)]
    bm.open([OpenRequest(i, p) for i, p in enumerate(prompts)])
    bm.commit([CommitRequest(i, args.prompt_len, args.prompt_len) for i in range(args.seqs)])
    lens = [args.prompt_len] * args.seqs
    reserve_us, commit_us, step_us = [], [], []
    for _ in range(args.steps):
        accepted = [rng.randint(0, k) + 1 for _ in range(args.seqs)]
        new_ids = [[rng.randrange(150_000) for _ in range(a)] for a in accepted]
        reserves = [ReserveRequest(i, lens[i] + k + 1) for i in range(args.seqs)]
        commits = [CommitRequest(i, lens[i] + accepted[i], lens[i] + accepted[i], new_ids[i])
                   for i in range(args.seqs)]
        t0 = time.perf_counter_ns()
        bm.reserve(reserves)
        t1 = time.perf_counter_ns()
        bm.commit(commits)
        t2 = time.perf_counter_ns()
        reserve_us.append((t1 - t0) / 1e3)
        commit_us.append((t2 - t1) / 1e3)
        step_us.append((t2 - t0) / 1e3)
        lens = [n + a for n, a in zip(lens, accepted)]
    return reserve_us, commit_us, step_us


def floor_us(seqs: int, repeats: int = 2000) -> float:
    """Median time of the barest per-sequence loop: look up a record, write two fields."""

    class Record:
        __slots__ = ("a", "b")

    records = {i: Record() for i in range(seqs)}
    times = []
    for step in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(seqs):
            record = records[i]
            record.a = step
            record.b = step
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores, load = os.cpu_count(), os.getloadavg()[0]
    # The 1-minute load says how much the other processes competed for the cores (and so the p99).
    return (f"{cpu}, {cores} cores, 1-min load {load:.1f} at the end, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def publish(report: str, out: Path | None) -> int:
    """Print a markdown report and, given a path, write it there too; the exit status of a bench."""
    print(report)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--num-speculative-tokens", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None, help="write a markdown result here")
    args = parser.parse_args()
    rng = random.Random(0)
    reserve_us, commit_us, step_us = [], [], []
    for _ in range(args.rounds):
        r, c, s = run_round(args, rng)
        reserve_us += r
        commit_us += c
        step_us += s
    floor = floor_us(args.seqs)
    rows = [(name, percentile(v, 0.5), percentile(v, 0.99)) for name, v in
            (("reserve", reserve_us), ("commit", commit_us), ("reserve + commit", step_us))]
    table = ["| call | p50 (us) | p99 (us) |", "| --- | ---: | ---: |"]
    table += [f"| {name} | {p50:.1f} | {p99:.1f} |" for name, p50, p99 in rows]
    table.append(f"| floor: bare loop over {args.seqs} records | {floor:.1f} | |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    command = "python -m bench.bench_blocks " + " ".join(sys.argv[1:])
    report = "\n".join([
        "# BlockManager: batched reserve + commit, one decode step", "",
        f"- machine: {machine()}", f"- command: `{command}`", f"- commit: {commit}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- shape: {args.seqs} sequences, prompt {args.prompt_len} tokens, tokens_per_block "
        f"{args.tokens_per_block}, K = {args.num_speculative_tokens}, {args.steps} steps x "
        f"{args.rounds} rounds; each step reserves len + K + 1 and commits 1..K+1 accepted tokens with "
        "their ids (full blocks are hashed into the prefix cache); request lists are built before the "
        "clock starts", "",
        *table, "",
    ])
    return publish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
