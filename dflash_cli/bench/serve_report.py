"""What `dflash_cli.bench.serve_load` measured, as numbers and files: percentiles, one summary per
setting and per pass, the acceptance and any named counter from two sets of Prometheus scrapes, and
the run's JSON and markdown (the PNGs are `serve_plots`').

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

from dflash_cli.bench.serve_gaps import gap_stats, timeline
from dflash_cli.bench.serve_plots import plot, plot_gaps
from dflash_cli.bench.serve_workload import lengths_from_args, setting_label

SPEC_COUNTERS = {  # our field -> the Prometheus sample (vLLM's, which dflash serve exposes too)
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
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


def summarize_requests(results: list, duration_s: float) -> dict:
    """Requests (`serve_request.RequestResult`s) as rates, latency percentiles and failures.

    Throughput counts completed requests over the wall time, first send to last answer; ITL pools every
    gap of every request, the other latencies are one value per request."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok),
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
    }


def summarize_setting(mode: str, value: float, results: list, duration_s: float,
                      accepted: dict | None, passes: list[dict] | None = None) -> dict:
    """One setting: every request of its passes pooled (their wall times summed), and each pass's own
    summary (`summarize_pass`) in `passes`."""
    return {
        "mode": mode, "value": value, **summarize_requests(results, duration_s), "acceptance": accepted,
        "per_request": [{"ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e, "output_tokens": r.output_tokens,
                         "prompt_tokens": r.prompt_tokens, "chunks": len(r.chunk_at), "error": r.error,
                         "replica": r.replica}
                        for r in results],
        "passes": passes or [],
    }


def summarize_pass(number: int, kind: str, results: list, *, started: float, ended: float, origin: float,
                   threshold_s: float, accepted: dict | None, counters: dict[str, float | None]) -> dict:
    """One pass (`number` from 1) of a setting: the request numbers, the gaps between tokens, what the
    server's counters added over it, and when each chunk arrived (perf_counter times; `origin` the run's
    start)."""
    return {"pass": number, "kind": kind, "started_s": started - origin,
            **summarize_requests(results, ended - started), **gap_stats(results, threshold_s),
            "acceptance": accepted, "metrics_counters": counters, "timeline": timeline(results, origin)}


def _samples(text: str, model: str | None):
    """(name, labels, value) of each sample of a Prometheus text; series of another model_name, and
    lines whose value is no number, skipped."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        if model and labels.get("model_name", model) != model:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        yield match["name"], labels, value


def sample_counters(text: str, model: str | None = None,
                    samples: dict[str, str] = SPEC_COUNTERS) -> dict[str, dict[str, float]]:
    """{replica label: {our field: value}} from one Prometheus text (one replica's, or several), for the
    samples named in `samples` (our field -> sample name); series of one sample that differ in another
    label (vLLM's engine) are summed."""
    wanted = {sample: ours for ours, sample in samples.items()}
    found: dict[str, dict[str, float]] = {}
    for name, labels, value in _samples(text, model):
        if name in wanted:
            mine = found.setdefault(labels.get("replica", ""), {})
            mine[wanted[name]] = mine.get(wanted[name], 0.0) + value
    return found


def latest_counters(texts: list[str], model: str | None = None,
                    samples: dict[str, str] = SPEC_COUNTERS) -> dict[str, dict[str, float]]:
    """Per replica label, the largest value of each counter over several scrapes (counters only grow,
    so the largest is the latest this client saw)."""
    latest: dict[str, dict[str, float]] = {}
    for text in texts:
        for replica, counters in sample_counters(text, model, samples).items():
            mine = latest.setdefault(replica, {})
            for name, value in counters.items():
                mine[name] = max(mine.get(name, value), value)
    return latest


def replicas_seen(texts: list[str], model: str | None = None) -> set[str]:
    """Every replica label on any sample of the scrapes ("" for samples without one)."""
    return {labels.get("replica", "") for text in texts for _, labels, _ in _samples(text, model)}


def _added(before: dict, after: dict, replicas: list[str], names) -> dict[str, float]:
    return {name: sum(after.get(r, {}).get(name, 0.0) - before.get(r, {}).get(name, 0.0) for r in replicas)
            for name in names}


def acceptance(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """What the run added, over the replicas seen both before and after (one seen only after would
    count its whole history); mean acceptance length = 1 + accepted / drafts (the bonus token counts)."""
    both = sorted(set(before) & set(after))
    added = _added(before, after, both, SPEC_COUNTERS)
    drafts = added["drafts"]
    return {"replicas": both, "unmatched_replicas": sorted(set(before) ^ set(after)), **added,
            "mean_acceptance_length": 1 + added["accepted"] / drafts if drafts else None}


def acceptance_between(before_texts: list[str], after_texts: list[str], model: str | None = None
                       ) -> dict | None:
    """`acceptance` of the spec-decode counters of two sets of scrapes; None when either saw none."""
    before, after = latest_counters(before_texts, model), latest_counters(after_texts, model)
    return acceptance(before, after) if before and after else None


def counter_deltas(before_texts: list[str], after_texts: list[str], names: list[str],
                   model: str | None = None) -> dict[str, float | None]:
    """What each named counter (its sample name, e.g. `..._total`) added between two sets of scrapes,
    summed over the replicas seen in both. A replica seen before without the counter counts it from 0
    (a labelled counter appears at its first increment); None where no scrape after holds it."""
    samples = {name: name for name in names}
    before = latest_counters(before_texts, model, samples)
    after = latest_counters(after_texts, model, samples)
    both = sorted(replicas_seen(before_texts, model) & replicas_seen(after_texts, model))
    added = _added(before, after, both, names)
    return {name: added[name] if any(name in after.get(r, {}) for r in both) else None for name in names}


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


def _cell(summary: dict | None, scale: float) -> str:
    if summary is None:
        return "-"
    return f"{summary['mean'] * scale:.1f} / {summary['p50'] * scale:.1f} / {summary['p99'] * scale:.1f}"


def _failed(summary: dict) -> str:
    return ", ".join(f"{n} x {why}" for why, n in summary["failures"].items()) or "0"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _length(summary: dict) -> str:
    length = (summary["acceptance"] or {}).get("mean_acceptance_length")
    return "-" if length is None else f"{length:.2f}"


def pass_rows(doc: dict) -> list[str]:
    """The per-pass table: what a user met in each pass (p99 TTFT, the longest gap, gaps over the
    threshold) beside the medians, throughput and what the named counters added."""
    counters = doc["metrics_counters"]
    header = ["setting", "pass", "done", "failed", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
              "longest gap ms", f"gaps > {doc['gap_threshold_ms']:g} ms", "req/s", "output tok/s",
              "acceptance length", *(f"{name} added" for name in counters)]
    rows = [f"| {' | '.join(header)} |", "| --- " * len(header) + "|"]
    for s in doc["settings"]:
        for p in s["passes"]:
            ttft, itl = p["ttft_s"] or {}, p["itl_s"] or {}
            added = ["-" if p["metrics_counters"].get(n) is None else f"{p['metrics_counters'][n]:g}"
                     for n in counters]
            cells = [setting_label(s["mode"], s["value"]), f"{p['pass']} {p['kind']}",
                     f"{p['completed']}/{p['requests']}", _failed(p), _ms(ttft.get("p50")),
                     _ms(ttft.get("p99")), _ms(itl.get("p50")), _ms(itl.get("p99")), _ms(p["longest_gap_s"]),
                     str(p["gaps_over_threshold"]), f"{p['request_throughput']:.2f}",
                     f"{p['output_throughput']:.1f}", _length(p), *added]
            rows.append(f"| {' | '.join(cells)} |")
    return rows


def markdown(doc: dict) -> str:
    header = " | ".join(f"{name} {unit} mean / p50 / p99" for _, name, _, unit in METRICS)
    rows = []
    for s in doc["settings"]:
        cells = " | ".join(_cell(s[key], scale) for key, _, scale, _ in METRICS)
        rows.append(f"| {setting_label(s['mode'], s['value'])} | {s['completed']}/{s['requests']} | "
                    f"{_failed(s)} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
                    f"{cells} | {_length(s)} |")
    warmup = ("none (--cold: the first measured request is the server's first)" if doc["cold"] else
              "one request before the first setting, not counted")
    return "\n".join([
        f"# Serving load: {doc['name']}", "",
        f"- date {doc['date']}, commit {doc['commit']}",
        f"- command: `{doc['command']}`",
        f"- server: {doc['url']}, model {doc['model']} (its device is not visible to a client: see the "
        "results index for the server's command)",
        f"- client: {doc['client']}",
        f"- {doc['num_prompts']} {doc['prompts']} prompts per pass of {doc['input_len']} tokens, "
        f"{doc['output_len']} output tokens each (greedy, ignore_eos), "
        f"{'streamed' if doc['stream'] else 'not streamed'}, seed {doc['seed']}",
        f"- passes per setting: {' '.join(doc['passes'])} (new: prompts no earlier pass sent; repeat: the "
        f"pass before it again); warm-up: {warmup}", "",
        "Per setting, every pass pooled:", "",
        f"| setting | done | failed | req/s | output tok/s | {header} | acceptance length |",
        "| --- " * (6 + len(METRICS)) + "|", *rows, "",
        "Per pass:", "", *pass_rows(doc), "",
        "TTFT: to the first chunk with text; ITL: between chunks with text (a chunk carries every token one "
        "speculative step accepted); the longest gap and the gaps over the threshold are ITLs too; TPOT: "
        "(E2E - TTFT) / (output tokens - 1) per request; throughput: completed requests over the wall time. "
        "Acceptance length: 1 + accepted / drafts of the server's counters over the setting or pass.", "",
    ])


_ATOM = r"(?:-?(?:\d[\d.eE+-]*|Infinity)|NaN|null)"
_FLAT_LIST = re.compile(rf"\[\s*{_ATOM}(?:\s*,\s*{_ATOM})*\s*\]")


def compact_json(doc: dict) -> str:
    """Indented JSON with every list of plain numbers on one line: the arrival times of every chunk
    would otherwise take a line each."""
    text = json.dumps(doc, indent=2)
    return _FLAT_LIST.sub(lambda m: "[" + ", ".join(re.split(r"\s*,\s*", m[0][1:-1].strip())) + "]", text)


def _length_field(args: argparse.Namespace, which: str) -> int | str:
    """The JSON's input_len / output_len: the integer when fixed (as before), else the distribution."""
    lengths = lengths_from_args(args, which)
    return lengths.low if lengths.values is None and lengths.low == lengths.high else lengths.label


def write_results(result: dict, args: argparse.Namespace, tokenizer_dir: str) -> dict:
    """<out>/<name>.json, .md, .png and _gaps.png, with the run's header; returns the document written."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    doc = {"name": args.name,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
           "commit": commit or "unknown", "command": getattr(args, "command_line", ""),
           "client": client_machine(), "url": result["url"], "model": result["model"],
           "prompts": args.prompts, "num_prompts": args.num_prompts,
           "input_len": _length_field(args, "input"), "output_len": _length_field(args, "output"),
           "input_lens_file": args.input_lens_file, "output_lens_file": args.output_lens_file,
           "seed": args.seed, "stream": args.stream, "passes": args.passes, "cold": args.cold,
           "gap_threshold_ms": args.gap_threshold_ms, "metrics_counters": args.metrics_counter or [],
           "tokenizer_dir": tokenizer_dir, "settings": result["settings"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(compact_json(doc) + "\n")
    text = markdown(doc)
    (out / f"{args.name}.md").write_text(text)
    plot(doc, out / f"{args.name}.png")
    plot_gaps(doc, out / f"{args.name}_gaps.png")
    print(text)
    return doc
