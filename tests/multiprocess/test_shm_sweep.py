"""The sweep of dead owners' files covers everything an owner leaves in /dev/shm: the pool, the step
buffers and the step channel of a process killed without running its finalizers (a SIGKILLed target
actor leaves its step buffers and channel as a SIGKILLed pool leaves its pages)."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

from foundation.shared_buffer import OwnedBuffer
from foundation.shm import sweep_stale_files
from foundation.step_channel import StepChannel

SPAWN = multiprocessing.get_context("spawn")
TIMEOUT_S = 60


def _own_files(shm_dir: str, conn) -> None:
    step = OwnedBuffer.allocate(4096, "cpu", share=True, file_name=f"dflash-step-{os.getpid()}-x",
                                shm_dir=shm_dir, sweep_stale=False)
    channel = StepChannel.create(f"dflash-channel-{os.getpid()}-x", shm_dir=shm_dir)
    conn.send([str(step.file.path), str(channel.path)])
    conn.recv()  # held until killed


def test_a_killed_owners_step_buffers_and_channel_are_swept_and_a_live_owners_are_not(tmp_path):
    parent, child = SPAWN.Pipe()
    owner = SPAWN.Process(target=_own_files, args=(str(tmp_path), child))
    owner.start()
    assert parent.poll(TIMEOUT_S)
    dead_paths = [Path(p) for p in parent.recv()]
    mine = OwnedBuffer.allocate(4096, "cpu", share=True, file_name=f"dflash-step-{os.getpid()}-live",
                                shm_dir=tmp_path, sweep_stale=False)
    other = tmp_path / "not-ours"
    other.write_bytes(b"x")
    try:
        assert sweep_stale_files(tmp_path) == []  # every owner alive: nothing goes
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(TIMEOUT_S)
        assert all(path.exists() for path in dead_paths)  # SIGKILL runs no finalizer
        assert sorted(sweep_stale_files(tmp_path)) == sorted(dead_paths)
        assert not any(path.exists() for path in dead_paths)
        assert mine.file.path.exists() and other.exists()  # a live owner's file and a stranger's stay
    finally:
        mine.file.remove()
