"""What `dflash_cli.bench.serve_load` measured, as numbers and files: percentiles, one summary per
setting, the acceptance from two sets of Prometheus counters, and the run's JSON, markdown and PNG.

Plain functions over plain numbers and texts, apart from the load generator, so the arithmetic is
tested against numpy and hand-made /metrics texts with no server. A client cannot see the server's
device: the header records the client machine and the URL, and the server's command goes in the
results index beside the bench's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
from collections import Counter
from pathlib import Path

from dflash_cli.bench.plotting import pyplot

SPEC_COUNTERS = {  # our field -> the Prometheus sample (vLLM's names under dflash:)
    "drafts": "dflash:spec_decode_num_drafts_total",
    "draft_tokens": "dflash:spec_decode_num_draft_tokens_total",
    "accepted": "dflash:spec_decode_num_accepted_tokens_total",
}
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
METRICS = (("ttft_s", "TTFT", 1e3, "ms"), ("tpot_s", "TPOT", 1e3, "ms"), ("itl_s", "ITL", 1e3, "ms"),
           ("e2e_s", "E2E", 1.0, "s"))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default method)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> dict | None:
    """Mean, median and p99 of a sample (None when it is empty)."""
    if not values:
        return None
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p99": percentile(values, 99), "count": len(values)}


def summarize_setting(mode: str, value: float, results: list, duration_s: float,
                      accepted: dict | None) -> dict:
    """One setting's requests (`serve_load.RequestResult`s) as rates, latency percentiles and failures.

    Throughput counts completed requests over the setting's wall time, first send to last answer;
    ITL pools every gap of every request, the other latencies are one value per request."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "mode": mode, "value": value, "requests": len(results), "completed": len(ok),
        "failures": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": tokens / duration_s,
        "output_tokens": tokens,
        "output_tokens_min_max": [min((r.output_tokens for r in ok), default=0),
                                  max((r.output_tokens for r in ok), default=0)],
        "usage_missing": sum(not r.usage_reported for r in ok),
        "ttft_s": summarize([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": summarize([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": summarize([gap for r in ok for gap in r.itl]),
        "e2e_s": summarize([r.e2e for r in ok]),
        "replicas_seen": dict(sorted(Counter(r.replica for r in results if r.replica is not None).items())),
        "acceptance": accepted,
        "per_request": [{"ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e, "output_tokens": r.output_tokens,
                         "chunks": len(r.itl) + (r.ttft is not None), "error": r.error, "replica": r.replica}
                        for r in results],
    }


def spec_counters(text: str, model: str | None = None) -> dict[str, dict[str, float]]:
    """{replica label: {drafts, draft_tokens, accepted}} from one Prometheus text (one replica's, or
    several); series of another model_name are skipped."""
    wanted = {sample: ours for ours, sample in SPEC_COUNTERS.items()}
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match["name"] not in wanted:
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        if model and labels.get("model_name", model) != model:
            continue
        found.setdefault(labels.get("replica", ""), {})[wanted[match["name"]]] = float(match["value"])
    return found


def latest_counters(texts: list[str], model: str | None = None) -> dict[str, dict[str, float]]:
    """Per replica label, the largest value of each counter over several scrapes (counters only grow,
    so the largest is the latest this client saw)."""
    latest: dict[str, dict[str, float]] = {}
    for text in texts:
        for replica, counters in spec_counters(text, model).items():
            mine = latest.setdefault(replica, {})
            for name, value in counters.items():
                mine[name] = max(mine.get(name, value), value)
    return latest


def acceptance(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """What the run added, over the replicas seen both before and after (one seen only after would
    count its whole history); mean acceptance length = 1 + accepted / drafts (the bonus token counts)."""
    both = sorted(set(before) & set(after))
    added = {name: sum(after[r].get(name, 0.0) - before[r].get(name, 0.0) for r in both)
             for name in SPEC_COUNTERS}
    drafts = added["drafts"]
    return {"replicas": both, "unmatched_replicas": sorted(set(before) ^ set(after)), **added,
            "mean_acceptance_length": 1 + added["accepted"] / drafts if drafts else None}


def client_machine() -> str:
    """This (the client's) machine in words: CPU model, cores, OS."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return f"{os.cpu_count()}-core {model}, {platform.system()} {platform.machine()}, " \
           f"Python {platform.python_version()}"


def _label(setting: dict) -> str:
    return f"{'rate' if setting['mode'] == 'request_rate' else 'concurrency'} {setting['value']:g}"


def _cell(summary: dict | None, scale: float) -> str:
    if summary is None:
        return "-"
    return f"{summary['mean'] * scale:.1f} / {summary['p50'] * scale:.1f} / {summary['p99'] * scale:.1f}"


def markdown(doc: dict) -> str:
    header = " | ".join(f"{name} {unit} mean / p50 / p99" for _, name, _, unit in METRICS)
    rows = []
    for s in doc["settings"]:
        failed = ", ".join(f"{n} x {why}" for why, n in s["failures"].items()) or "0"
        length = (s["acceptance"] or {}).get("mean_acceptance_length")
        cells = " | ".join(_cell(s[key], scale) for key, _, scale, _ in METRICS)
        rows.append(f"| {_label(s)} | {s['completed']}/{s['requests']} | {failed} | "
                    f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {cells} | "
                    f"{'-' if length is None else f'{length:.2f}'} |")
    return "\n".join([
        f"# Serving load: {doc['name']}", "",
        f"- date {doc['date']}, commit {doc['commit']}",
        f"- command: `{doc['command']}`",
        f"- server: {doc['url']}, model {doc['model']} (its device is not visible to a client: see the "
        "results index for the server's command)",
        f"- client: {doc['client']}",
        f"- {doc['num_prompts']} {doc['prompts']} prompts of {doc['input_len']} tokens per setting, "
        f"{doc['output_len']} output tokens each (greedy, ignore_eos), "
        f"{'streamed' if doc['stream'] else 'not streamed'}, seed {doc['seed']}", "",
        f"| setting | done | failed | req/s | output tok/s | {header} | acceptance length |",
        "| --- " * (6 + len(METRICS)) + "|", *rows, "",
        "TTFT: to the first chunk with text; ITL: between chunks with text (a chunk carries every token one "
        "speculative step accepted); TPOT: (E2E - TTFT) / (output tokens - 1) per request; throughput: "
        "completed requests over the setting's wall time. Acceptance length: 1 + accepted / drafts of the "
        "server's counters over the setting.", "",
    ])


def plot(doc: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    settings = doc["settings"]
    x = range(len(settings))
    labels = [_label(s) for s in settings]
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


def write_results(result: dict, args: argparse.Namespace, tokenizer_dir: str) -> dict:
    """<out>/<name>.json, .md and .png, with the run's header; returns the document written."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    doc = {"name": args.name,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
           "commit": commit or "unknown", "command": getattr(args, "command_line", ""),
           "client": client_machine(), "url": result["url"], "model": result["model"],
           "prompts": args.prompts, "num_prompts": args.num_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "seed": args.seed, "stream": args.stream,
           "tokenizer_dir": tokenizer_dir, "settings": result["settings"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = markdown(doc)
    (out / f"{args.name}.md").write_text(text)
    plot(doc, out / f"{args.name}.png")
    print(text)
    return doc
