"""The tables of `bench/serving_h200.sh`'s results: the split (inprocess against ray), a fresh plain
server's first passes (without and with the warm-up forwards, and under eager module loading), and long
prompts beside decodes under each prefill cap.

    python -m bench.serving_report DIR [--out FILE.md]

DIR holds what the script's tarball unpacks to (each run's `dflash bench serve` JSON, the servers' logs,
env.txt). Numbers are read off those files; nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

SLOW_LINE = re.compile(r"kept the running streams waiting (\d+) ms: (.*)")
LONG_PROMPT = 1000  # tokens: the budget runs' long prompts are 3,000, their short ones 32


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:,.1f}"


def setting(path: Path) -> dict:
    return json.loads(path.read_text())["settings"][0]


def slow_steps(log: Path) -> list[tuple[int, str]]:
    if not log.is_file():
        return []
    return [(int(m[1]), m[2]) for m in map(SLOW_LINE.search, log.read_text().splitlines()) if m]


def split_section(root: Path) -> list[str]:
    lines = ["## dflash serve (Ray Serve), --services inprocess against ray", "",
             "| concurrency | inprocess output tok/s (rounds) | ray output tok/s (rounds) | ray / inprocess "
             "(medians) | TTFT p50 ms inprocess / ray | ITL p50 ms inprocess / ray |",
             "| --- | --- | --- | --- | --- | --- |"]
    for c in (1, 32):
        runs = {mode: [setting(p) for p in sorted(root.glob(f"split_{mode}_c{c}_r*.json"))]
                for mode in ("inprocess", "ray")}
        if not all(runs.values()):
            lines.append(f"| {c} | missing | missing | - | - | - |")
            continue
        tok = {mode: [s["output_throughput"] for s in runs[mode]] for mode in runs}
        med = {mode: statistics.median(tok[mode]) for mode in tok}
        ttft = {mode: statistics.median(s["ttft_s"]["p50"] for s in runs[mode]) for mode in runs}
        itl = {mode: statistics.median(s["itl_s"]["p50"] for s in runs[mode]) for mode in runs}
        rounds = {mode: ", ".join(f"{t:,.0f}" for t in tok[mode]) for mode in tok}
        lines.append(f"| {c} | {med['inprocess']:,.0f} ({rounds['inprocess']}) | "
                     f"{med['ray']:,.0f} ({rounds['ray']}) | "
                     f"{med['ray'] / med['inprocess']:.3f} | {ms(ttft['inprocess'])} / {ms(ttft['ray'])} | "
                     f"{ms(itl['inprocess'])} / {ms(itl['ray'])} |")
    return [*lines, ""]


def _run_order(path: Path) -> tuple[int, str]:
    """first_<variant>_<i>: by i (the order they ran), then by name."""
    index = path.stem.rsplit("_", 1)[-1]
    return (int(index) if index.isdigit() else 0, path.stem)


def first_section(root: Path) -> list[str]:
    lines = ["## A fresh plain server's first passes (C 8, prompts of 16-3,000 tokens, empty Triton cache)",
             "",
             "| run | ready s | pass | TTFT p99 ms | ITL p99 ms | longest gap ms | gaps > 250 ms | req/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    slow: dict[str, list[tuple[int, str]]] = {}
    runs = sorted((path for path in root.glob("first_*.json") if not path.stem.endswith("_startup")),
                  key=_run_order)
    for result in runs:
        run = result.stem.removeprefix("first_")
        ready = json.loads((root / f"{result.stem}_startup.json").read_text())["ready_s"]
        for one in setting(result)["passes"]:
            cells = [run, ready, f"{one['pass']} {one['kind']}", ms(one["ttft_s"]["p99"]),
                     ms(one["itl_s"]["p99"]), ms(one["longest_gap_s"]), one["gaps_over_threshold"],
                     f"{one['request_throughput']:.2f}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        slow[run] = slow_steps(root / f"{result.stem}.log")
    lines += ["", "Engine steps with decodes that took over 85 ms (`DFLASH_SLOW_STEP_MS=85`), in order:", ""]
    for variant, steps in slow.items():
        listed = "; ".join(f"{took} ms ({what})" for took, what in steps) or "none"
        lines.append(f"- {variant}: {len(steps)}: {listed}")
    return [*lines, ""]


def budget_section(root: Path) -> list[str]:
    lines = ["## Long prompts beside decodes (C 8: 3 in 4 prompts of 32 tokens, 1 in 4 of 3,000; 128 out)",
             "",
             "| prefill cap beside decodes | TTFT p50 / p99 ms, 3,000-token prompts | TTFT p50 / p99 ms, "
             "32-token prompts | ITL p50 / p99 ms | longest gap ms | steps > 85 ms | output tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for cap in ("none", "1024", "512"):
        result = root / f"budget_{cap}.json"
        if not result.is_file():
            lines.append(f"| {cap} | missing | | | | | |")
            continue
        data = setting(result)
        one = data["passes"][0]
        by_length = {True: [], False: []}
        for request in data["per_request"]:
            if request["ttft_s"] is not None and request.get("prompt_tokens") is not None:
                by_length[request["prompt_tokens"] >= LONG_PROMPT].append(request["ttft_s"])
        long, short = by_length[True], by_length[False]
        cells = [cap, f"{ms(percentile(long, 50))} / {ms(percentile(long, 99))}",
                 f"{ms(percentile(short, 50))} / {ms(percentile(short, 99))}",
                 f"{ms(one['itl_s']['p50'])} / {ms(one['itl_s']['p99'])}", ms(one["longest_gap_s"]),
                 len(slow_steps(root / f"budget_{cap}.log")), f"{one['output_throughput']:,.0f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    env = (args.root / "env.txt").read_text().strip() if (args.root / "env.txt").is_file() else "unknown"
    text = "\n".join([f"Device and versions: {env}", "", *split_section(args.root), *first_section(args.root),
                      *budget_section(args.root)])
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
