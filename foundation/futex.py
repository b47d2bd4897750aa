"""Block until a word of shared memory changes, and wake who waits on it: Linux futexes, through ctypes.

Why not sleep-polling: a waiter that sleeps in `time.sleep` steps of up to 0.5 ms answers a request
that arrives mid-sleep ~0.3 ms late on average (measured with `python -m bench.bench_step_channel`), more
than a multiprocessing Pipe's whole round trip, and a shorter step burns the core it was meant to
spare. A futex sleeps in the kernel and is woken within microseconds by the writer's FUTEX_WAKE.

Shared (not FUTEX_PRIVATE) futexes are keyed by the mapped file's page and offset, so two processes
mapping one /dev/shm file meet on the same word. The futex compares only the low 32 bits of our
int64 words (little-endian: they sit at the word's address); a sequence number's low half changes at
each step, which is all a waiter needs. Where the syscall is missing (an architecture not listed
below, a sandbox without it) `wait` falls back to a short sleep, so callers stay correct but slower.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import platform
import sys
import time

logger = logging.getLogger(__name__)

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1
FALLBACK_SLEEP_S = 200e-6


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
available = _SYS_FUTEX is not None and _libc is not None and sys.byteorder == "little"


def _low32(value: int) -> int:
    """The low 32 bits of `value` as the signed int the kernel compares."""
    low = value & 0xFFFFFFFF
    return low - 2**32 if low >= 2**31 else low


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at `address` equals `expected`'s low half, at most `timeout_s`.

    Returns on a wake-up, a timeout, a signal, or at once if the word already differs: callers
    re-read the word and loop, as with any futex (spurious returns are allowed).
    """
    global available
    if not available:
        time.sleep(min(timeout_s, FALLBACK_SLEEP_S))
        return
    seconds = max(timeout_s, 0.0)
    timeout = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    result = _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAIT),
                           ctypes.c_int(_low32(expected)), ctypes.byref(timeout), None, ctypes.c_int(0))
    if result == -1 and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        available = False
        logger.warning("futex syscall unavailable (%s); falling back to sleep-polling",
                       errno.errorcode[ctypes.get_errno()])


def wake(address: int) -> None:
    """Wake every process waiting on the word at `address` (a no-op syscall when none waits)."""
    if available:
        _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE),
                      ctypes.c_int(_WAKE_ALL), None, None, ctypes.c_int(0))
