"""Collect the shipped demo pair's training record into bench/results/demo_pair.json and .png.

    python -m bench.bench_demo_pair_report [--models target_service/demo_models]

Reads the pair's train_log.json files, the drafter's eval.json and commands.json (what
bench/bench_train_demo.py ran, with wall times), and draws both loss curves and the acceptance by draft
position (DFlash against prompt lookup).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _plot(target: dict, drafter: dict, evaluation: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for axis, log, title in ((axes[0], target, "target"), (axes[1], drafter, "drafter")):
        steps = [record["step"] for record in log["history"]]
        axis.plot(steps, [record["loss"] for record in log["history"]], label="train loss")
        if "accuracy" in log["history"][0]:
            axis.plot(steps, [record["accuracy"] for record in log["history"]], label="block accuracy")
        if "held_out_loss" in log:
            axis.axhline(log["held_out_loss"], color="grey", linestyle="--", label="held-out loss")
        axis.set(xlabel="step", title=f"{title}: {log['parameters'] / 1e6:.2f}M parameters")
        axis.legend()
    for name, counts in evaluation["accepted_per_position"].items():
        drafts = evaluation[name]["all"]["num_drafts"]
        mean = evaluation[name]["all"]["mean_acceptance_length"]
        axes[2].plot(range(1, len(counts) + 1), [c / drafts for c in counts], marker="o",
                     label=f"{name} (mean acceptance length {mean:.2f})")
    axes[2].set(xlabel="draft position k", ylabel="P(first k drafts accepted)",
                title=f"held-out code, K={evaluation['num_speculative_tokens']}, greedy")
    axes[2].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=str(ROOT / "target_service" / "demo_models"))
    parser.add_argument("--name", default="demo_pair")
    args = parser.parse_args()
    models = Path(args.models)
    target = json.loads((models / "target" / "train_log.json").read_text())
    drafter = json.loads((models / "drafter" / "train_log.json").read_text())
    evaluation = json.loads((models / "drafter" / "eval.json").read_text())
    commands = json.loads((models / "commands.json").read_text())
    sizes = {str(f.relative_to(models)): f.stat().st_size for f in sorted(models.rglob("*")) if f.is_file()}
    record = {"commands": commands, "files": sizes, "total_bytes": sum(sizes.values()),
              "target": target, "drafter": {k: v for k, v in drafter.items() if k != "eval"},
              "eval": evaluation}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    _plot(target, drafter, evaluation, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
