"""The listening TCP sockets of a process tree, read from Linux's /proc (psutil is not a dependency):
/proc/net/tcp and tcp6 list every socket in LISTEN state by inode, and /proc/<pid>/fd links name the
inodes a process holds."""

from __future__ import annotations

import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


@dataclass(frozen=True)
class ListeningSocket:
    host: str  # "127.0.0.1", "::", "::ffff:127.0.0.1", ...
    port: int
    pid: int
    process: str  # the program's base name (gcs_server, raylet, python) or its Ray title (ray::ProxyActor)

    @property
    def on_loopback(self) -> bool:
        address = ipaddress.ip_address(self.host)
        mapped = getattr(address, "ipv4_mapped", None)  # an IPv6 socket bound to 127.0.0.1
        return (mapped or address).is_loopback


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone since the listing
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])  # the field after "(comm) state"
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def listening_sockets(pids: list[int]) -> list[ListeningSocket]:
    """Every TCP socket in LISTEN state that one of `pids` holds, sorted."""
    by_inode = _listening_by_inode()
    found = set()
    for pid in pids:
        try:
            descriptors = os.listdir(PROC / str(pid) / "fd")
        except OSError:
            continue
        for descriptor in descriptors:
            try:
                target = os.readlink(PROC / str(pid) / "fd" / descriptor)
            except OSError:
                continue
            inode = target.removeprefix("socket:[").removesuffix("]")
            if target.startswith("socket:[") and inode in by_inode:
                host, port = by_inode[inode]
                found.add(ListeningSocket(host, port, pid, process_name(pid)))
    return sorted(found, key=lambda s: (s.port, s.host, s.pid))


def process_name(pid: int) -> str:
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace").strip()
    return first.split()[0] if first.startswith("ray::") else os.path.basename(first)


def environment(pid: int) -> dict[str, str]:
    """The environment `pid` started with (what its parent gave it)."""
    raw = (PROC / str(pid) / "environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _listening_by_inode() -> dict[str, tuple[str, int]]:
    table = {}
    for name, width in (("tcp", 4), ("tcp6", 16)):
        lines = (PROC / "net" / name).read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == TCP_LISTEN:
                hex_host, hex_port = local.split(":")
                table[inode] = (_host(bytes.fromhex(hex_host), width), int(hex_port, 16))
    return table


def _host(raw: bytes, width: int) -> str:
    # /proc/net/tcp{,6} print the address as 32-bit words in the host's byte order
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
    return str(ipaddress.ip_address(raw))
