"""Markdown table and plot of `bench_e2e_step` results (split out so the bench reads as the method)."""

from __future__ import annotations

from pathlib import Path

# The goals (H200, Qwen3-8B): ms per plain decode step and per DFlash step, by batch size.
GOALS_MS = {"plain": {1: 6.0, 32: 14.0}, "dflash": {1: 6.5, 32: 20.0}}


def _ms(spread: dict) -> str:
    return f"{spread['median'] * 1e3:.2f} ({spread['p10'] * 1e3:.2f}-{spread['p90'] * 1e3:.2f})"


def markdown(result: dict) -> str:
    hf = {(row["batch"], row["context"]): row for row in result["hf"]}
    lines = [
        f"# End-to-end step: {result['name']}",
        "",
        f"- device {result['device']}, torch {result['torch']}, commit {result['commit']}, "
        f"date {result['date']}",
        f"- command: `{result['command']}`",
        f"- geometry {result['geometry']} (random weights), {result['dtype']}, "
        f"K {result['num_speculative_tokens']}, acceptance simulated around "
        f"{result['simulate_acceptance']} (bench only), {result['steps']} timed steps per case; "
        f"pool {result['pool_blocks']} blocks of {result['tokens_per_block']}",
        "",
        "ms per step: median (p10-p90). tok/s counts emitted tokens over the timed steps.",
        "",
        "| B | context | prefill s | plain ms/step | plain tok/s | DFlash ms/step | DFlash tok/s "
        "| acceptance | launches plain / DFlash | GPU busy ms plain / DFlash | HF decode ms "
        "| HF verify K+1 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in result["engine"]:
        plain, spec = case["plain"], case["dflash"]
        ref = hf.get((case["batch"], case["context"]))
        lines.append(
            f"| {case['batch']} | {case['context']} | {case['prefill_s']:.2f} | {_ms(plain)} | "
            f"{plain['tokens_per_s']:.0f} | {_ms(spec)} | {spec['tokens_per_s']:.0f} | "
            f"{spec['mean_acceptance_length']:.2f} | {plain.get('kernel_launches', '-')} / "
            f"{spec.get('kernel_launches', '-')} | {plain.get('gpu_busy_ms', '-')} / "
            f"{spec.get('gpu_busy_ms', '-')} | "
            f"{_ms(ref['decode']) if ref else '-'} | {_ms(ref['verify']) if ref else '-'} |"
        )
    if result["skipped"]:
        lines += [
            "",
            "Not run: "
            + ", ".join(f"B {s['batch']} ctx {s['context']} ({s['why']})" for s in result["skipped"]),
        ]
    lines += [
        "",
        "Goals (issue): plain decode <= 6 ms at B 1 and <= 14 ms at B 32; a DFlash step <= 6.5 ms at "
        "B 1 and <= 20 ms at B 32.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({case["context"] for case in result["engine"]})
    figure, axes = plt.subplots(
        1, max(len(contexts), 1), figsize=(5 * max(len(contexts), 1), 4), squeeze=False
    )
    hf = {(row["batch"], row["context"]): row for row in result["hf"]}
    for axis, context in zip(axes[0], contexts):
        cases = [case for case in result["engine"] if case["context"] == context]
        batches = [case["batch"] for case in cases]
        axis.plot(batches, [c["plain"]["tokens_per_s"] for c in cases], marker="o", label="engine plain")
        axis.plot(batches, [c["dflash"]["tokens_per_s"] for c in cases], marker="o", label="engine DFlash")
        refs = [(b, hf[(b, context)]) for b in batches if (b, context) in hf]
        if refs:
            axis.plot(
                [b for b, _ in refs],
                [b / r["decode"]["median"] for b, r in refs],
                marker="s",
                linestyle="--",
                label="HF eager plain",
            )
        for name, goals in GOALS_MS.items():
            acceptance = result["simulate_acceptance"] if name == "dflash" else 1.0
            axis.scatter(
                list(goals),
                [b * acceptance / (ms / 1e3) for b, ms in goals.items()],
                marker="*",
                s=90,
                label=f"goal {name}",
            )
        axis.set(
            xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s", title=f"context {context}"
        )
        axis.legend(fontsize=7)
    figure.suptitle(f"{result['device']}, {result['geometry']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
