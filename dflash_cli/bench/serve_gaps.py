"""The gaps between tokens a user waits through: per pass the longest one and how many pass a threshold,
and the arrival time of every chunk with text (for the record, and for serve_report's plot of gap
against wall time).

A p99 of inter-token latency pools thousands of gaps, so a stall of a few requests (a kernel compiled
for a new shape, a prefix cache filled) hides in it; the longest gap and the count over a threshold
do not. Gaps are those of completed requests, as for the ITL percentiles: one is the time between two
chunks with text (one chunk carries every token a speculative step accepted).
"""

from __future__ import annotations

import itertools

DEFAULT_GAP_THRESHOLD_MS = 250.0
TIME_DECIMALS = 4  # arrival times are recorded to 0.1 ms: the JSON stays small, the plot unchanged


def gap_stats(results: list, threshold_s: float) -> dict:
    """The longest gap between tokens of any completed request (None without two chunks anywhere), and
    the number of gaps longer than `threshold_s`."""
    gaps = [gap for r in results if r.ok for gap in r.itl]
    return {"longest_gap_s": max(gaps, default=None),
            "gaps_over_threshold": sum(gap > threshold_s for gap in gaps)}


def timeline(results: list, origin: float) -> dict:
    """Per completed request, when it was sent and when each chunk with text arrived, in seconds since
    `origin` (the run's start): `sent_at_s[i]` and `chunk_at_s[i]` belong to the i-th of them."""
    done = [r for r in results if r.ok]
    return {"sent_at_s": [None if r.sent_at is None else round(r.sent_at - origin, TIME_DECIMALS)
                          for r in done],
            "chunk_at_s": [[round(t - origin, TIME_DECIMALS) for t in r.chunk_at] for r in done]}


def gap_points(recorded: dict) -> tuple[list[float], list[float]]:
    """(arrival time s, gap ms) of every gap of a timeline: the gap ends at the chunk that closes it."""
    times, gaps = [], []
    for chunks in recorded["chunk_at_s"]:
        for before, after in itertools.pairwise(chunks):
            times.append(after)
            gaps.append((after - before) * 1e3)
    return times, gaps
