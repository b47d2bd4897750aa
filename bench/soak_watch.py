"""What the soak watches on the server's side, read from Linux's /proc (psutil is not a dependency):
the replicas' memory, file descriptors and CPU time, /health, and /dev/shm, sampled on a thread
while the clients run, so a leak shows as a trend and a restart as a changed pid.

The server is a process tree: `dflash serve`, the local Ray it started (GCS, raylet, agents) and the
Ray workers, among them the Serve proxy (every HTTP connection ends there) and one process per model
replica (titled `ray::ServeReplica:<app>:<deployment>`), where the engine runs and its pages live.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROC = Path("/proc")
SHM = Path("/dev/shm")
REPLICA_TITLE = "ray::ServeReplica:"
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024
TICKS = os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone since the listing
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def title(pid: int) -> str:
    """The program's first argument: Ray workers set it to their title (ray::ProxyActor)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def replica_pids(root: int) -> list[int]:
    return sorted(pid for pid in process_tree(root) if title(pid).startswith(REPLICA_TITLE))


def rss_kib(pid: int) -> int:
    try:
        return int((PROC / str(pid) / "statm").read_text().split()[1]) * PAGE_KIB
    except (OSError, IndexError, ValueError):
        return 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(PROC / str(pid) / "fd"))
    except OSError:
        return 0


def cpu_s(pid: int) -> float:
    """User plus system CPU time of `pid`, in seconds."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14 and 15 of stat(5)


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy (not idle, not waiting on I/O) since boot."""
    fields = [int(v) for v in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICKS  # user .. steal, less idle and iowait


def shm_entries() -> dict[str, int]:
    """Every /dev/shm entry with its size in bytes."""
    entries = {}
    for path in SHM.iterdir() if SHM.is_dir() else ():
        try:
            entries[path.name] = path.stat().st_size
        except OSError:
            continue
    return entries


def shm_held(pids: list[int]) -> set[str]:
    """The /dev/shm names that `pids` hold open or mapped: a file the server made, not a neighbour's."""
    held = set()
    for pid in pids:
        base = PROC / str(pid)
        try:
            targets = [os.readlink(base / "fd" / fd) for fd in os.listdir(base / "fd")]
            targets += [line.split(maxsplit=5)[-1] for line in (base / "maps").read_text().splitlines()
                        if "/dev/shm/" in line]
        except OSError:
            continue
        held.update(Path(t.removesuffix(" (deleted)")).name for t in targets if t.startswith("/dev/shm/"))
    return held


@dataclass(frozen=True)
class Sample:
    t_s: float  # from the soak's start
    replicas: dict[int, tuple[int, int, float]]  # pid -> (RSS KiB, open fds, CPU s)
    tree_fds: int  # every process of the server, Ray's included
    health: int | str  # GET /health's status, or the exception's name
    load_1m: float  # the machine's 1-minute load
    # CPU seconds so far, to tell what else competed for the cores: the machine, the server, the soak
    machine_cpu_s: float
    server_cpu_s: float
    soak_cpu_s: float


def sample(root: int, http: httpx.Client, t_s: float) -> Sample:
    tree = process_tree(root)
    replicas = {pid: (rss_kib(pid), fd_count(pid), cpu_s(pid)) for pid in tree
                if title(pid).startswith(REPLICA_TITLE)}
    try:
        health: int | str = http.get("/health").status_code
    except httpx.HTTPError as error:
        health = type(error).__name__
    own = os.times()
    return Sample(t_s, replicas, sum(fd_count(pid) for pid in tree), health, os.getloadavg()[0],
                  machine_busy_s(), sum(cpu_s(pid) for pid in tree), own.user + own.system)


@dataclass
class ServerWatch:
    """Samples the server every `period_s` on a daemon thread, from `start(t0)` until `stop()`."""

    root: int
    url: str
    period_s: float = 1.0
    samples: list[Sample] = field(default_factory=list)

    def start(self, t0: float) -> ServerWatch:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(t0,), name="soak-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def _run(self, t0: float) -> None:
        with httpx.Client(base_url=self.url, timeout=5.0) as http:
            while not self._stop.is_set():
                self.samples.append(sample(self.root, http, time.perf_counter() - t0))
                self._stop.wait(self.period_s)
