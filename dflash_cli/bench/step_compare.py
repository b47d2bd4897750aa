"""Adaptive speculation against fixed K, side by side: step-bench results of separate runs merged.

    python -m dflash_cli.bench.step_compare RUN.json [RUN.json ...] --out DIR [--name NAME]

Each engine is its own run of `dflash_cli.bench.step` (K decides the CUDA graphs it captures, so a fixed
K 7 and an adaptive K 15 cannot share one engine); this puts their cases in one table: per batch and
context, each run's median ms (p10-p90), tok/s and realised acceptance length, and the adaptive run's
tok/s over the best fixed run's, with the drafts its steps verified. Runs are labelled by what their
engine did (`adaptive K 15`, `K 7`), so the files may come in any order. Writes NAME.md and NAME.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def label(run: dict) -> str:
    k = run.get("num_speculative_tokens", "?")
    return f"adaptive K {k}" if run.get("adaptive_speculation") else f"K {k}"


def compare(runs: list[dict]) -> dict:
    """The merged record: rows keyed by (batch, context) in the order the first run timed them."""
    labels = [label(run) for run in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two runs of the same engine: {labels}")
    cases = {label(run): {(c["batch"], c["context"]): c for c in run.get("dflash", [])} for run in runs}
    plain = {(c["batch"], c["context"]): c for run in runs for c in run.get("plain", [])}
    keys = list(dict.fromkeys(key for run in runs for key in cases[label(run)]))
    adaptive = [name for name in labels if name.startswith("adaptive")]
    fixed = [name for name in labels if not name.startswith("adaptive")]
    rows = []
    for key in keys:
        row = {"batch": key[0], "context": key[1], "runs": {}}
        if key in plain:
            row["plain_ms"] = plain[key]["graphs"]["median"] * 1e3
        for name in labels:
            case = cases[name].get(key)
            if case is not None:
                graphs = case["graphs"]
                row["runs"][name] = {"ms": graphs["median"] * 1e3, "p10_ms": graphs["p10"] * 1e3,
                                     "p90_ms": graphs["p90"] * 1e3, "tokens_per_s": graphs["tokens_per_s"],
                                     "acceptance": graphs["mean_acceptance_length"],
                                     "steps_by_drafts": case.get("decode_steps_by_drafts")}
        best = max((row["runs"][name]["tokens_per_s"] for name in fixed if name in row["runs"]), default=None)
        for name in adaptive:
            if name in row["runs"] and best:
                row["runs"][name]["over_best_fixed"] = row["runs"][name]["tokens_per_s"] / best
        rows.append(row)
    first = runs[0]
    return {"labels": labels, "rows": rows, "device": first.get("device"), "date": first.get("date"),
            "commits": sorted({run.get("commit", "?") for run in runs}),
            "commands": [run.get("command") for run in runs],
            "acceptance": f"{first.get('simulate_acceptance')} ({first.get('acceptance_curve', 'poisson')})"}


def _run_cell(run: dict | None) -> str:
    if run is None:
        return "-"
    return (f"{run['ms']:.2f} ({run['p10_ms']:.2f}-{run['p90_ms']:.2f}), {run['tokens_per_s']:,.0f}, "
            f"{run['acceptance']:.2f}")


def _steps_cell(steps: dict | None) -> str:
    if not steps:
        return "-"
    return ", ".join(f"{k}: {steps[k]}" for k in sorted(steps, key=int))


def markdown(merged: dict, name: str) -> str:
    labels = merged["labels"]
    adaptive = [lab for lab in labels if lab.startswith("adaptive")]
    header = ["B", "context", "plain ms", *(f"{lab}: ms, tok/s, acceptance" for lab in labels),
              *(f"{lab} / best fixed tok/s" for lab in adaptive),
              *(f"{lab}: steps by drafts" for lab in adaptive)]
    lines = [f"# Adaptive speculation against fixed K: {name}", "",
             f"- device {merged['device']}, date {merged['date']}, commits {', '.join(merged['commits'])}",
             f"- simulated acceptance {merged['acceptance']}; ms: median (p10-p90) from CUDA graphs; tok/s: "
             "emitted tokens over the timed graph steps; acceptance: realised mean acceptance length",
             *(f"- `{command}`" for command in merged["commands"]), "",
             "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in merged["rows"]:
        cells = [str(row["batch"]), str(row["context"]),
                 f"{row['plain_ms']:.2f}" if "plain_ms" in row else "-"]
        for lab in labels:
            cells.append(_run_cell(row["runs"].get(lab)))
        for lab in adaptive:
            ratio = row["runs"].get(lab, {}).get("over_best_fixed")
            cells.append("-" if ratio is None else f"{ratio:.3f}")
        for lab in adaptive:
            cells.append(_steps_cell(row["runs"].get(lab, {}).get("steps_by_drafts")))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "The steps by drafts are the adaptive engine's counter, cumulative over the cases it ran "
              "before (one engine runs every case of its run, in the order above)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="step-bench JSON files, one per engine")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="step_compare")
    args = parser.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as error:
            parser.error(f"{path}: not a step-bench result ({error})")
    try:
        merged = compare(runs)
    except (KeyError, TypeError, ValueError) as error:
        parser.error(f"cannot compare these runs: {error!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(merged, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(merged, args.name))
    print(markdown(merged, args.name))


if __name__ == "__main__":
    main()
