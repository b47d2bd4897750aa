"""Soak a real `dflash serve`: many streaming clients for minutes, some leaving early, some with short
timeouts, some poisoned; afterwards nothing may be left behind and the second half may be no worse
than the first (issue 30).

    python -m bench.soak [--duration-s 600] [--clients 64] [--replicas 2] [--max-num-seqs 16]
        [--kv-cache-memory 64MiB] [--poison-rate 0.1] [--seed 0]
        [--out FILE (default: bench/results/soak_cpu_<date>.json)]

The server is the one the serving tests start (`tests/serving/serve_process.Server`: `dflash serve`
with the demo pair on CPU, its own local Ray on loopback with token authentication), with the flags
above; the bounded version is tests/serving/test_soak.py, over the same `run_soak`. The clients are
`bench.soak_clients`, what is watched on the server `bench.soak_watch`, the figures and verdicts
`bench.soak_report`. Every verdict is written as measured, a failed one included; the exit status is
1 when one failed.

What "left behind" is read from: pages and live sequences from every replica's admin gRPC port
(`KVPoolClient.stats`, once the last request ended), file descriptors from /proc/PID/fd of the whole
process tree (the Serve proxy holds the HTTP connections, the replicas the engines), /dev/shm entries
the server holds (before against after the load, and any left with its pids after it stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.soak_clients import Client, Record, SoakLoad, prompt_texts
from bench.soak_poisons import POISONS
from bench.soak_report import halves, latency, memory, outcomes, server_faults, verdicts
from bench.soak_watch import ServerWatch, fd_count, process_tree, replica_pids, shm_entries, shm_held

ROOT = Path(__file__).resolve().parent.parent
QUIET_TIMEOUT_S = 30.0  # after the last request, how long its pages may take to come back
FD_SETTLE_S = 3.0  # closed connections leave the proxy's and replicas' fd tables
END_GRACE_S = 120.0  # past the deadline, how long the requests in flight may still run


@dataclass(frozen=True)
class SoakServer:
    """The server under soak as the soak reaches it: its URL, the root of its process tree, and the
    admin gRPC address of every replica."""

    url: str
    root_pid: int
    admin_addresses: tuple[str, ...]


def pool_usage(server: SoakServer) -> list[dict]:
    from kvpool_service.client import KVPoolClient

    usages = []
    for address in server.admin_addresses:
        with KVPoolClient(address) as client:
            stats = client.stats()
        usages.append({"address": address, "num_used_blocks": stats.num_used_blocks,
                       "num_seqs": stats.num_seqs, "num_cached_blocks": stats.num_cached_blocks})
    return usages


def wait_for_quiet(server: SoakServer, timeout_s: float = QUIET_TIMEOUT_S) -> tuple[list[dict], float]:
    """Pool usage once no replica holds a page or a sequence (or when `timeout_s` ran out), and how
    long that took."""
    started = time.monotonic()
    while True:
        usages = pool_usage(server)
        quiet = all(u["num_used_blocks"] == 0 and u["num_seqs"] == 0 for u in usages)
        if quiet or time.monotonic() - started > timeout_s:
            return usages, time.monotonic() - started
        time.sleep(0.2)


def footprint(server: SoakServer) -> dict:
    """What may leak, at one moment: fds of the tree and of each replica, /dev/shm entries."""
    tree = process_tree(server.root_pid)
    replicas = replica_pids(server.root_pid)
    return {"tree_fds": sum(fd_count(pid) for pid in tree),
            "replica_fds": {pid: fd_count(pid) for pid in replicas}, "replicas": replicas,
            "shm": shm_entries(), "shm_held": shm_held(tree)}


async def drive(server: SoakServer, load: SoakLoad, clients: int, duration_s: float, seed: int,
                t0: float) -> tuple[list[Record], float]:
    """Every client until the deadline, then the requests in flight to their end. Returns the
    records and how long the last ones ran past the deadline."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    prompts, poisons = prompt_texts(256, seed), itertools.cycle(POISONS)
    async with httpx.AsyncClient(base_url=server.url, limits=limits) as http:
        team = [Client(index, http, load, prompts, seed, poisons) for index in range(clients)]
        deadline = t0 + duration_s
        first_round = {0: len(POISONS)}  # client 0 opens with one of each poison
        running = asyncio.gather(*(client.run(t0, deadline, poisons_first=first_round.get(client.index, 0))
                                   for client in team))
        await asyncio.wait_for(running, duration_s + END_GRACE_S)
    return [record for client in team for record in client.records], time.perf_counter() - deadline


def warm_up(server: SoakServer, load: SoakLoad, requests: int = 4) -> None:
    """A few short requests before anything is measured: every replica's first step pays its
    one-time costs (allocator, lazy imports) outside the first half."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for _ in range(requests):
            body = {"model": load.model, "prompt": "def f(x):", "max_tokens": 8, "ignore_eos": True}
            http.post("/v1/completions", json=body).raise_for_status()


def run_soak(server: SoakServer, *, clients: int, duration_s: float, load: SoakLoad | None = None,
             seed: int = 0, fd_slack: int = 8, rss_floor_mib: float = 8.0, period_s: float = 1.0) -> dict:
    """Warm up, soak for `duration_s`, wait for the pages to come back, and measure: the result
    document (without the run's own facts: device, command, commit; `main` adds them)."""
    load = load or SoakLoad()
    warm_up(server, load)
    before = footprint(server)
    t0 = time.perf_counter()
    watch = ServerWatch(server.root_pid, server.url, period_s).start(t0)
    records, overrun_s = asyncio.run(drive(server, load, clients, duration_s, seed, t0))
    pages, quiet_s = wait_for_quiet(server)
    time.sleep(FD_SETTLE_S)
    samples = watch.stop()
    after = footprint(server)
    faults = [f"client {r.client} {r.kind} at {r.started_s:.1f} s: {r.fault}" for r in records
              if r.outcome == "fault"]
    new_shm = sorted(set(after["shm"]) - set(before["shm"]))
    doc = {
        "settings": {"clients": clients, "duration_s": duration_s, "seed": seed, "fd_slack": fd_slack,
                     "rss_floor_mib": rss_floor_mib, "sample_period_s": period_s,
                     "load": dataclasses.asdict(load)},
        "requests": outcomes(records),
        "faults": {"count": len(faults), "first": faults[:20]},
        "overrun_s": overrun_s,
        "pages_after": pages, "pages_quiet_after_s": quiet_s,
        "fds": {"tree_before": before["tree_fds"], "tree_after": after["tree_fds"],
                "replicas_before": before["replica_fds"], "replicas_after": after["replica_fds"]},
        "dev_shm": {"before": len(before["shm"]), "after": len(after["shm"]), "new": new_shm,
                    "new_of_server": sorted(set(new_shm) & (after["shm_held"] | before["shm_held"])),
                    "held_by_server_before": sorted(before["shm_held"]),
                    "held_by_server_after": sorted(after["shm_held"])},
        "server": {"replica_pids_before": before["replicas"], "replica_pids_after": after["replicas"],
                   **server_faults(samples, before["replicas"])},
        "halves": {},
    }
    record_halves = halves(records, lambda r: r.started_s, duration_s)
    sample_halves = halves(samples, lambda s: s.t_s, duration_s)
    for name, recs, samps in zip(("first", "second"), record_halves, sample_halves):
        doc["halves"][name] = {"requests": len(recs), "latency": latency(recs), "memory": memory(samps)}
    doc["records"] = [dataclasses.asdict(r) for r in records] if clients * duration_s <= 2000 else None
    doc["verdicts"] = verdicts(doc, fd_slack, rss_floor_mib)
    return doc


def leftover_shm(root_pids: list[int]) -> list[str]:
    """/dev/shm entries of the project (`dflash-*`) still named with one of the server's pids."""
    marks = {f"-{pid}-" for pid in root_pids}
    return sorted(name for name in shm_entries()
                  if name.startswith("dflash-") and any(mark in name for mark in marks))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.rstrip("\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=16, help="per replica")
    p.add_argument("--kv-cache-memory", default="64MiB", help="pool budget per replica")
    p.add_argument("--poison-rate", type=float, default=SoakLoad.poison_rate)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="the result JSON (default: bench/results/soak_cpu_<date>.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    for path in (ROOT / "tests", ROOT / "tests" / "serving"):  # the serving tests' server, reused
        sys.path.insert(0, str(path))
    from serve_process import Server

    from dflash_cli.bench.serve_report import client_machine

    date = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or ROOT / "bench" / "results" / f"soak_cpu_{date:%Y%m%d}.json"
    flags = ("--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory)
    started = time.monotonic()
    server = Server(*flags, replicas=args.replicas)
    print(f"soak: dflash serve ready in {time.monotonic() - started:.0f} s at {server.url}", flush=True)
    target = SoakServer(server.url, server.process.pid,
                        tuple(f"127.0.0.1:{server.admin_port + rank}" for rank in range(args.replicas)))
    tree = process_tree(server.process.pid)
    try:
        doc = run_soak(target, clients=args.clients, duration_s=args.duration_s,
                       load=dataclasses.replace(SoakLoad(), poison_rate=args.poison_rate), seed=args.seed)
    finally:
        server.stop()
    doc["dev_shm"]["left_after_stop"] = leftover_shm(tree)
    doc["verdicts"]["no_dev_shm_left_after_stop"] = not doc["dev_shm"]["left_after_stop"]
    doc["server"]["exit_status"] = server.process.returncode
    doc = {"name": out.stem, "device": client_machine(), "command": "python -m bench.soak " + " ".join(argv),
           "commit": _git("rev-parse", "--short", "HEAD"),
           "uncommitted_changes": _git("status", "--porcelain", "--", "*.py").splitlines(),
           "date": date.isoformat(timespec="minutes"), "server_flags": [*flags, "--replicas",
                                                                       str(args.replicas)], **doc}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    failed = [name for name, ok in doc["verdicts"].items() if ok is False]
    print(f"soak: wrote {out}; verdicts failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
