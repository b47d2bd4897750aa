"""The soak's figures and verdicts, from its records and samples: plain Python over what was seen.

Halves: a request belongs to the half it was sent in, a sample to the half it was taken in. Latency
is over the completed streams of complete-role clients (no client timeout, no early leave): TTFT
and the gaps between events with text (ITL). Memory is the replicas' summed RSS; a half's growth is
the median of its last tenth of samples less the median of its first tenth (medians: one sample
taken during a garbage collection does not make a trend).

Verdicts (issue 30's soak): zero pages in use and no live sequence after; no new /dev/shm entry of
the server's; the server's fds back within `fd_slack` of before; the second half's memory growth and
p99 TTFT and ITL within 10% of the first's (growth: or under `rss_floor_mib`, below which RSS moves
by the allocator's whims, not by requests); /health 200 throughout; the replica pids unchanged (the
engine never restarted); no fault.
"""

from __future__ import annotations

import statistics
from collections import Counter

from bench.soak_clients import Record
from bench.soak_watch import Sample
from dflash_cli.bench.serve_report import percentile

TOLERANCE = 0.10
MiB = 1024.0  # KiB per MiB


def halves(items: list, time_of, duration_s: float) -> tuple[list, list]:
    middle = duration_s / 2
    first = [item for item in items if time_of(item) < middle]
    return first, [item for item in items if middle <= time_of(item) <= duration_s]


def latency(records: list[Record]) -> dict:
    done = [r for r in records if r.kind == "complete" and r.outcome == "completed"]
    ttft = [r.ttft_s for r in done]
    itl = [gap for r in done for gap in r.itl_s]
    tokens = sum(r.tokens for r in done)

    def stats(values: list[float]) -> dict | None:
        if not values:
            return None
        return {"p50_ms": 1e3 * percentile(values, 50), "p99_ms": 1e3 * percentile(values, 99),
                "count": len(values)}

    return {"completed_streams": len(done), "tokens": tokens, "ttft": stats(ttft), "itl": stats(itl)}


def memory(samples: list[Sample]) -> dict | None:
    """Summed replica RSS (MiB) over one half's samples, and the CPU seconds the half took: the
    replicas', the whole server's, the soak's own clients', and everything else's on the machine
    (other work on shared cores: what makes one half's latency worse without the server's doing)."""
    if len(samples) < 2:
        return None
    rss = [sum(r[0] for r in s.replicas.values()) / MiB for s in samples]
    tenth = max(1, len(rss) // 10)
    cpu = [sum(r[2] for r in s.replicas.values()) for s in samples]
    first, last = samples[0], samples[-1]
    server, soak = last.server_cpu_s - first.server_cpu_s, last.soak_cpu_s - first.soak_cpu_s
    return {"rss_start_mib": statistics.median(rss[:tenth]), "rss_end_mib": statistics.median(rss[-tenth:]),
            "rss_growth_mib": statistics.median(rss[-tenth:]) - statistics.median(rss[:tenth]),
            "rss_max_mib": max(rss), "replica_cpu_s": cpu[-1] - cpu[0], "server_cpu_s": server,
            "soak_client_cpu_s": soak,
            "other_cpu_s": last.machine_cpu_s - first.machine_cpu_s - server - soak,
            "wall_s": last.t_s - first.t_s,
            "load_1m_mean": statistics.fmean(s.load_1m for s in samples), "samples": len(samples)}


def outcomes(records: list[Record]) -> dict:
    by_kind = Counter(r.kind for r in records)
    by_outcome = Counter(r.outcome for r in records)
    poisons: dict[str, dict] = {}
    for r in records:
        if r.kind == "poison":
            entry = poisons.setdefault(r.poison, {"sent": 0, "statuses": Counter(), "wrong": 0})
            entry["sent"] += 1
            entry["statuses"][str(r.status)] += 1
            entry["wrong"] += r.outcome == "fault"
    return {"sent": len(records), "by_kind": dict(by_kind), "by_outcome": dict(by_outcome),
            "completed": by_outcome["completed"], "disconnected": by_outcome["disconnected"],
            "timed_out": by_outcome["timed_out"], "poisoned": by_kind["poison"],
            "poisons": {name: {**e, "statuses": dict(e["statuses"])} for name, e in sorted(poisons.items())}}


def server_faults(samples: list[Sample], replica_pids: list[int]) -> dict:
    """/health answers other than 200, and moments the replica pids were not the starting ones."""
    unhealthy = [(round(s.t_s, 1), s.health) for s in samples if s.health != 200]
    changed = [(round(s.t_s, 1), sorted(s.replicas)) for s in samples if sorted(s.replicas) != replica_pids]
    return {"health_not_200": unhealthy[:20], "health_not_200_count": len(unhealthy),
            "replica_pids_changed": changed[:20], "health_samples": len(samples)}


def within(second: float | None, first: float | None, floor: float = 0.0) -> bool | None:
    if second is None or first is None:
        return None
    return second <= max(first * (1 + TOLERANCE), first + floor) if first > 0 else second <= floor


def verdicts(doc: dict, fd_slack: int, rss_floor_mib: float) -> dict:
    pages = doc["pages_after"]
    first, second = doc["halves"]["first"], doc["halves"]["second"]
    mem1, mem2 = first["memory"] or {}, second["memory"] or {}

    def p99(half: dict, what: str) -> float | None:
        return (half["latency"][what] or {}).get("p99_ms")

    return {
        "no_fault": doc["faults"]["count"] == 0,
        "zero_pages_in_use_after": all(p["num_used_blocks"] == 0 and p["num_seqs"] == 0 for p in pages),
        "no_dev_shm_leak": not doc["dev_shm"]["new_of_server"],
        "fds_back_within_slack": doc["fds"]["tree_after"] - doc["fds"]["tree_before"] <= fd_slack,
        "health_200_throughout": doc["server"]["health_not_200_count"] == 0,
        "replicas_never_restarted": not doc["server"]["replica_pids_changed"],
        "rss_growth_second_half_within_10pct": within(mem2.get("rss_growth_mib"), mem1.get("rss_growth_mib"),
                                                      rss_floor_mib),
        "p99_ttft_second_half_within_10pct": within(p99(second, "ttft"), p99(first, "ttft")),
        "p99_itl_second_half_within_10pct": within(p99(second, "itl"), p99(first, "itl")),
    }
