"""What carrying each request's deltas across a Ray actor boundary costs the engine's step loop.

An actor runs a stand-in step loop in a thread, as the target service does: each step holds the GIL
for `--host-ms` (the step's Python: scheduling, reading, publishing) and then releases it for
`--device-ms` (the wait on the GPU), then hands one delta (a real `RequestDelta`, 6 tokens) to each of
`--requests` requests. The driver (the replica's place) reads them two ways:

- per request: one Ray streaming-generator call per request, one streamed item per delta (what
  `RemoteEngine` did first);
- multiplexed: one streaming call for the whole actor, one item per step carrying every request's
  delta, routed to each request's queue on the driver's side.

Reported per way: the step loop's mean period against its `host + device` ideal (what the transport's
work took from the step through the GIL), the actor's and the driver's CPU per delta.

    .venv/bin/python -m bench.bench_delta_transport [--requests 32 --steps 300 --rounds 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import threading
import time
from pathlib import Path

from bench.bench_blocks import machine, publish
from target_service.engine.engine_client import RequestDelta


class StepLoopActor:
    """A stand-in target service: a thread of steps feeding deltas to the asyncio side."""

    def __init__(self, num_requests: int, host_s: float, device_s: float):
        self.num_requests, self.host_s, self.device_s = num_requests, host_s, device_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queues: list[asyncio.Queue] = []
        self.outbox: asyncio.Queue | None = None
        self.periods: list[float] = []

    async def start(self, num_steps: int, multiplexed: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.queues = [asyncio.Queue() for _ in range(self.num_requests)]
        self.outbox = asyncio.Queue()
        self.periods = []
        self.cpu_start = time.process_time()
        threading.Thread(target=self._steps, args=(num_steps, multiplexed), daemon=True).start()

    def _steps(self, num_steps: int, multiplexed: bool) -> None:
        last = time.perf_counter()
        for step in range(num_steps):
            busy_until = time.perf_counter() + self.host_s
            while time.perf_counter() < busy_until:  # the step's Python, holding the GIL
                pass
            time.sleep(self.device_s)  # the GPU's share: the GIL is free
            finished = step == num_steps - 1
            deltas = [RequestDelta(f"req-{i}", [step, step + 1, 7, 8, 9, 10], " tokens", finished=finished,
                                   num_prompt_tokens=128, num_output_tokens=6 * (step + 1))
                      for i in range(self.num_requests)]
            if multiplexed:
                self.loop.call_soon_threadsafe(self.outbox.put_nowait, deltas)
            else:
                for queue, delta in zip(self.queues, deltas):
                    self.loop.call_soon_threadsafe(queue.put_nowait, delta)
            now = time.perf_counter()
            self.periods.append(now - last)
            last = now

    async def stream(self, index: int):
        while True:
            delta = await self.queues[index].get()
            yield delta
            if delta.finished:
                return

    async def deltas(self):
        while True:
            batch = await self.outbox.get()
            yield batch
            if batch[0].finished:
                return

    def result(self) -> dict:
        return {"periods": self.periods, "cpu_s": time.process_time() - self.cpu_start}


async def read_per_request(actor, num_requests: int) -> int:
    async def one(index: int) -> int:
        count = 0
        async for ref in actor.stream.options(num_returns="streaming").remote(index):
            await ref
            count += 1
        return count

    return sum(await asyncio.gather(*(one(i) for i in range(num_requests))))


async def read_multiplexed(actor, num_requests: int) -> int:
    queues = {f"req-{i}": asyncio.Queue() for i in range(num_requests)}

    async def route():
        async for ref in actor.deltas.options(num_returns="streaming").remote():
            for delta in await ref:
                queues[delta.request_id].put_nowait(delta)

    async def one(queue: asyncio.Queue) -> int:
        count = 0
        while not (await queue.get()).finished:
            count += 1
        return count + 1

    router = asyncio.ensure_future(route())
    counts = await asyncio.gather(*(one(queue) for queue in queues.values()))
    await router
    return sum(counts)


def run_once(actor, args, multiplexed: bool) -> dict:
    import ray

    ray.get(actor.start.remote(args.steps, multiplexed))
    cpu_start = time.process_time()
    reader = read_multiplexed if multiplexed else read_per_request
    delivered = asyncio.run(reader(actor, args.requests))
    driver_cpu = time.process_time() - cpu_start
    result = ray.get(actor.result.remote())
    assert delivered == args.requests * args.steps, (delivered, args.requests * args.steps)
    periods = result["periods"][5:]  # the first steps meet the readers' start
    return {"period_ms": 1e3 * statistics.mean(periods), "period_p50_ms": 1e3 * statistics.median(periods),
            "actor_us_per_delta": 1e6 * result["cpu_s"] / delivered,
            "driver_us_per_delta": 1e6 * driver_cpu / delivered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--host-ms", type=float, default=4.0)
    parser.add_argument("--device-ms", type=float, default=12.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import ray

    from target_service.assembly.ray_runtime import start_ray

    start_ray(None)
    actor = ray.remote(StepLoopActor).options(num_cpus=0).remote(args.requests, args.host_ms / 1e3,
                                                                 args.device_ms / 1e3)
    rows = {"per request": [], "multiplexed": []}
    for _ in range(args.rounds):  # alternated, so drift in the machine's load falls on both
        for way in rows:
            rows[way].append(run_once(actor, args, multiplexed=way == "multiplexed"))
    ideal = args.host_ms + args.device_ms
    lines = ["# Deltas across the actor boundary: per-request streams against one multiplexed stream",
             "", f"{machine()}; {datetime.date.today()}; {args.requests} requests, {args.steps} steps of "
             f"{args.host_ms:g} ms holding the GIL + {args.device_ms:g} ms releasing it (ideal period "
             f"{ideal:g} ms); {args.rounds} rounds, alternated; median (min-max) over rounds.", "",
             f"Command: `python -m bench.bench_delta_transport --requests {args.requests} --steps "
             f"{args.steps} --rounds {args.rounds} --host-ms {args.host_ms:g} "
             f"--device-ms {args.device_ms:g}`",
             "", "| way | step period mean ms | p50 ms | actor CPU us / delta | driver CPU us / delta |",
             "| --- | --- | --- | --- | --- |"]
    for way, results in rows.items():
        cells = []
        for key in ("period_ms", "period_p50_ms", "actor_us_per_delta", "driver_us_per_delta"):
            values = [r[key] for r in results]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        lines.append(f"| {way} | " + " | ".join(cells) + " |")
    publish("\n".join(lines) + "\n", args.out)
    ray.shutdown()


if __name__ == "__main__":
    main()
