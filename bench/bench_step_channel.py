"""Round trip of one no-op call on the step channel between two processes, against a pipe's.

The server is a spawned process that attached by handle (as the drafter actor does). Calls go
back to back (the server is still spinning from the last one) and after an idle gap (the server
has stopped spinning and blocks on its futex, as between a step's two calls while the target's
forward runs). Beside it: the same no-op over a multiprocessing Pipe (what the service-seam test
uses, and about the floor of any socket-based RPC in Python). `--device cuda` adds the channel's
GPU ordering, `--ordering flags` or `events` (a mark and a stream wait on each side per call, no GPU
work between; `foundation.gpu_ordering`).

    .venv/bin/python -m bench.bench_step_channel [--device cuda --ordering flags] --out FILE.md
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.bench_blocks import machine, percentile, publish
from foundation import futex
from foundation.gpu_ordering import ORDERINGS
from foundation.step_channel import SPIN_S, StepChannel


def serve_channel(handle, stop) -> None:
    channel = StepChannel.attach(handle)
    if channel.ordering is not None:
        torch.cuda.set_device(channel.ordering.device)
    channel.serve_forever(lambda opcode, args: None, stop.is_set)
    channel.close()


def serve_pipe(conn) -> None:
    while (message := conn.recv()) is not None:
        conn.send(message)


def time_calls(call, repeats: int, gap_s: float) -> list[float]:
    """Microseconds of each of `repeats` calls, each started `gap_s` after the previous returned."""
    for _ in range(50):  # warm up
        call()
    times = []
    for _ in range(repeats):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5000)
    parser.add_argument("--gaps-us", type=int, nargs="+", default=[0, 2000],
                        help="idle time before each call (0: back to back)")
    parser.add_argument("--device", default="cpu", help="cuda: the channel carries its GPU ordering")
    parser.add_argument("--ordering", default="auto", choices=ORDERINGS,
                        help="the GPU ordering on cuda: stream flags or CUDA IPC events")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    context = mp.get_context("spawn")
    channel, stop = StepChannel.create(device=args.device, ordering=args.ordering), context.Event()
    ordering = type(channel.ordering).__name__
    server = context.Process(target=serve_channel, args=(channel.export(), stop), daemon=True)
    near, far = context.Pipe()
    echo = context.Process(target=serve_pipe, args=(far,), daemon=True)
    server.start()
    echo.start()
    rows = []
    try:
        channel.wait_for_server(60)

        def pipe_call():
            near.send(0)
            near.recv()

        for gap_us in args.gaps_us:
            gap_s = gap_us / 1e6
            rows.append(("step channel", gap_us, time_calls(lambda: channel.call(0), args.repeats, gap_s)))
            rows.append(("multiprocessing Pipe", gap_us, time_calls(pipe_call, args.repeats, gap_s)))
    finally:
        stop.set()
        near.send(None)
        server.join(10)
        echo.join(10)
        channel.close()

    table = ["| call | idle before each call (us) | p50 (us) | p99 (us) |", "| --- | ---: | ---: | ---: |"]
    table += [f"| {name} | {gap} | {percentile(v, 0.5):.1f} | {percentile(v, 0.99):.1f} |"
              for name, gap, v in rows]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    report = "\n".join([
        "# Step channel: one no-op call between two processes", "",
        (f"- device: {torch.cuda.get_device_name()}: each call marks and waits on the GPU ordering "
         f"({ordering})" if torch.device(args.device).type == "cuda"
         else "- device: CPU only (no GPU ordering in this run)"),
        f"- machine: {machine()}",
        f"- command: `python -m bench.bench_step_channel {' '.join(sys.argv[1:])}`",
        f"- commit: {commit}", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- shape: {args.repeats} calls per row after 50 warm-up calls, no args, the handler returns "
        f"at once; each waiter spins {SPIN_S * 1e6:.0f} us, then blocks on a futex "
        f"({'available' if futex.available else 'UNAVAILABLE: sleep-polling'}); the Pipe row echoes one "
        "pickled int from a spawned process", "",
        *table, "",
    ])
    return publish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
