"""A free loopback port for a server a test starts in another process, chosen where nothing else
on the machine picks ports on its own.

Binding port 0 and closing it hands out a port from the kernel's ephemeral range, where the next
process to open a connection or a listener (Ray starts dozens) may take it before the server binds
it: `dflash serve` once failed to bind such a port. Ports from 20000 up to the ephemeral range's
start (32768 on Linux) are neither ephemeral nor Ray's (its workers use 10002-19999 by default).
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32767


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return HIGH + 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port in LOW..(the ephemeral range's start - 1) that binds on `host` now."""
    high = min(HIGH, _ephemeral_start() - 1)
    for port in random.sample(range(LOW, high + 1), 200):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LOW}..{high} on {host}")
