"""The PNGs of `dflash bench serve`: <name>.png, throughput and latency per setting, and <name>_gaps.png,
every gap between tokens against wall time (one colour per pass, the threshold a line), where a stall
that a percentile pools away shows as a column of dots above the line.

Both read the results document that `serve_report.write_results` writes; matplotlib comes through
`plotting.pyplot` (an optional extra: without it each PNG is skipped with one log line).
"""

from __future__ import annotations

from pathlib import Path

from dflash_cli.bench.plotting import pyplot
from dflash_cli.bench.serve_gaps import gap_points
from dflash_cli.bench.serve_workload import setting_label


def plot(doc: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    settings = doc["settings"]
    x = range(len(settings))
    labels = [setting_label(s["mode"], s["value"]) for s in settings]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    # requests/s is output tokens/s over a fixed output length: one line, the other as labels
    left.plot(x, [s["output_throughput"] for s in settings], marker="o")
    for i, s in zip(x, settings):
        length = (s["acceptance"] or {}).get("mean_acceptance_length")
        note = f"{s['request_throughput']:.2f} req/s" + ("" if length is None else f"\nacc. len {length:.2f}")
        left.annotate(note, (i, s["output_throughput"]), textcoords="offset points", xytext=(0, 8),
                      ha="center", fontsize=8)
    left.set(ylabel="output tokens/s", title=f"throughput, {doc['model']}")
    left.margins(x=0.12, y=0.25)
    for key, name, color in (("ttft_s", "TTFT", "tab:orange"), ("tpot_s", "TPOT", "tab:blue"),
                             ("e2e_s", "E2E", "tab:green")):
        points = [(i, s[key]) for i, s in zip(x, settings) if s[key] is not None]
        if points:
            right.plot([i for i, _ in points], [v["p50"] * 1e3 for _, v in points], marker="o", color=color,
                       label=f"{name} p50")
            right.plot([i for i, _ in points], [v["p99"] * 1e3 for _, v in points], ls="--", color=color,
                       label=f"{name} p99")
    right.set(yscale="log", ylabel="ms", title="latency (p50 solid, p99 dashed)")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.set_xticks(list(x), labels)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_gaps(doc: dict, path: Path) -> None:
    """Gap (ms, log) against seconds since the run's start; nothing (not even a skip line) when no pass
    recorded a gap, as in a run without a stream."""
    passes = [(s, p) for s in doc["settings"] for p in s.get("passes", ()) if gap_points(p["timeline"])[0]]
    if not passes:
        return
    plt = pyplot(path)
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labelled = set()
    for setting, one in passes:
        times, gaps = gap_points(one["timeline"])
        label = f"pass {one['pass']} {one['kind']}"
        axis.scatter(times, gaps, s=4, color=colors[(one["pass"] - 1) % len(colors)],
                     label=None if label in labelled else label)
        labelled.add(label)
        if one["pass"] == 1:  # where each setting begins
            axis.axvline(one["started_s"], color="0.7", lw=0.8, ls=":")
            axis.annotate(setting_label(setting["mode"], setting["value"]), (one["started_s"], 1),
                          xycoords=("data", "axes fraction"), xytext=(3, -10), textcoords="offset points",
                          fontsize=8, color="0.4")
    threshold = doc["gap_threshold_ms"]
    axis.axhline(threshold, color="tab:red", ls="--", lw=1, label=f"threshold {threshold:g} ms")
    axis.set(yscale="log", xlabel="s since the run's start", ylabel="gap between tokens, ms",
             title=f"gaps between chunks with text, {doc['model']}")
    axis.legend(fontsize=8, markerscale=3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
