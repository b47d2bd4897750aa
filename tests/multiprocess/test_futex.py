"""futex: a waiter in another process is woken by the writer's wake, not by its own timeout."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from foundation import futex
from foundation.shm import OwnedFile, map_file

SPAWN = multiprocessing.get_context("spawn")
READY, WORD, ELAPSED_US = 0, 1, 2  # int64 words of the shared file
LONG_TIMEOUT_S = 20


def _waiter(path: str, expected: int) -> None:
    words = map_file(path, 64).view(torch.int64)
    address = words.data_ptr() + 8 * WORD
    words[READY] = 1
    start = time.monotonic()
    while int(words[WORD]) == expected and time.monotonic() - start < LONG_TIMEOUT_S:
        futex.wait(address, expected, LONG_TIMEOUT_S)
    words[ELAPSED_US] = int((time.monotonic() - start) * 1e6)


def test_wait_returns_at_once_when_the_word_already_differs():
    words = torch.zeros(2, dtype=torch.int64)
    words[0] = 5 + 2**32  # only the low 32 bits are compared: 5 vs expected 6
    start = time.monotonic()
    futex.wait(words.data_ptr(), 6, 1.0)
    assert time.monotonic() - start < 0.5


@pytest.mark.slow
@pytest.mark.skipif(not futex.available, reason="no futex syscall here")
def test_a_waiter_in_another_process_is_woken_by_the_write_and_wake(tmp_path):
    owned = OwnedFile.create(tmp_path, f"futex-{os.getpid()}", 64)
    try:
        words = owned.map().view(torch.int64)
        expected = int(torch.randint(0, 2**62, ()))
        words[WORD] = expected
        process = SPAWN.Process(target=_waiter, args=(str(owned.path), expected))
        process.start()
        deadline = time.monotonic() + 60
        while int(words[READY]) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the waiter is now blocked in the kernel
        words[WORD] = expected + 1
        futex.wake(words.data_ptr() + 8 * WORD)
        process.join(LONG_TIMEOUT_S + 10)
        assert process.exitcode == 0
        assert 0.15e6 < int(words[ELAPSED_US]) < 5e6  # woken by the wake, long before its timeout
    finally:
        owned.remove()
