"""A step channel served by spawned processes, for the channel's tests: the caller's channel and a
shared buffer here, a server per process there, whose handler computes what the tests check (sums
of the args, and an affine map of the shared buffer: the step buffers' pattern, data in shared
memory and only counts in the call).
"""

from __future__ import annotations

import multiprocessing
import os
import time

import torch

from foundation.shared_buffer import OwnedBuffer, map_buffer
from foundation.step_channel import StepChannel

SPAWN = multiprocessing.get_context("spawn")
START_TIMEOUT_S = 60  # a spawned child imports torch; two cores, maybe another test worker beside
ADD, AFFINE, FAIL, SLEEP, PID, AFFINE_LATE = 1, 2, 3, 4, 5, 6
SLEEP_RESULT = 777
N = 64  # int64 elements of each half of the shared buffer: x (written here), y (written by the server)
GPU_SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: far longer than a round trip on the host


def _handler(data: torch.Tensor):
    x, y = data[:N], data[N:]

    def handle(opcode: int, args: tuple[int, ...]) -> int | None:
        if opcode == ADD:
            return sum(args)
        if opcode == AFFINE:  # y[:n] = x[:n] * a + b; returns the sum as a second check
            n, a, b = args
            torch.add(x[:n] * a, b, out=y[:n])
            return int(y[:n].sum())
        if opcode == AFFINE_LATE:  # the same on a GPU, queued behind a sleep, no host sync
            n, a, b = args
            torch.cuda._sleep(GPU_SLEEP_CYCLES)
            torch.add(x[:n] * a, b, out=y[:n])
            return None
        if opcode == FAIL:
            raise ValueError(f"refused {args[0]} " + "é" * args[1])
        if opcode == SLEEP:
            time.sleep(args[0] / 1000)
            return SLEEP_RESULT
        if opcode == PID:
            return os.getpid()
        raise KeyError(opcode)

    return handle


def _serve(channel_handle, buffer_handle, stop) -> None:
    data = map_buffer(buffer_handle).view(torch.int64)
    if data.is_cuda:
        torch.cuda.set_device(data.device)
    channel = StepChannel.attach(channel_handle)
    channel.serve_forever(_handler(data), stop.is_set)
    channel.close()


class Served:
    """The caller's channel, the shared buffer, and the server processes started on it (newest last)."""

    def __init__(self, device: str = "cpu", ordering: str = "auto"):
        self.channel = StepChannel.create(device=device, ordering=ordering)
        name = f"dflash-step-test-{os.getpid()}-{os.urandom(4).hex()}"
        self.buffer = OwnedBuffer.allocate(2 * N * 8, device, share=True, file_name=name, sweep_stale=False)
        data = self.buffer.tensor.view(torch.int64)
        self.x, self.y = data[:N], data[N:]
        self.stop = SPAWN.Event()
        self.processes = []

    def start_server(self, after_epoch: int = 0) -> multiprocessing.Process:
        process = SPAWN.Process(target=_serve, args=(self.channel.export(), self.buffer.export(), self.stop))
        process.start()
        self.processes.append(process)
        self.channel.wait_for_server(START_TIMEOUT_S, after_epoch=after_epoch)
        return process

    def close(self) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        self.channel.close()
        if self.buffer.file is not None:
            self.buffer.file.remove()


def affine_late_calls(served: Served, calls: int) -> None:
    """`calls` GPU-ordered affine maps: each side queues its writes behind a GPU sleep, no host sync."""
    for _ in range(calls):
        n, a, b = int(torch.randint(1, N + 1, ())), *torch.randint(-1000, 1000, (2,)).tolist()
        x = torch.randint(-10**6, 10**6, (n,), device="cuda")
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        served.x[:n].copy_(x)  # queued behind the sleep on this stream
        assert served.channel.call(AFFINE_LATE, n, a, b) == 0
        assert torch.equal(served.y[:n].cpu(), (x * a + b).cpu())  # this stream waits on the server
