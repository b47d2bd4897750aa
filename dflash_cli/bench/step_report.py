"""Markdown table and plot of `dflash_cli.bench.step` results (split out so the bench reads as the method)."""

from __future__ import annotations

from pathlib import Path

from dflash_cli.bench.plotting import pyplot
from dflash_cli.bench.proposer_modes import TOKEN_MODES

# The goals (H200, Qwen3-8B): ms per plain decode step and per DFlash step, by batch size.
GOALS_MS = {"plain": {1: 6.0, 32: 14.0}, "dflash": {1: 6.5, 32: 20.0}}


def _ms(spread: dict | None) -> str:
    if not spread:
        return "-"
    return f"{spread['median'] * 1e3:.2f} ({spread['p10'] * 1e3:.2f}-{spread['p90'] * 1e3:.2f})"


def _cell(case: dict | None, label: str, field: str, fmt: str = "{:.0f}") -> str:
    value = (case or {}).get(label, {}).get(field)
    return "-" if value is None else fmt.format(value)


def markdown(result: dict) -> str:
    plain = {(c["batch"], c["context"]): c for c in result["plain"]}
    hf = {(row["batch"], row["context"]): row for row in result["hf"]}
    lines = [
        f"# End-to-end step: {result['name']}",
        "",
        f"- device {result['device']}, torch {result['torch']}, commit {result['commit']}, "
        f"date {result['date']}",
        f"- command: `{result['command']}`",
        f"- geometry {result['geometry']} (random weights), {result['dtype']}, target K/V cache "
        f"{result.get('kv_cache_dtype', 'auto')}, "
        f"K {result.get('num_speculative_tokens', '-')}"
        f"{' (adaptive: each step chooses its drafts)' if result.get('adaptive_speculation') else ''}, "
        f"acceptance simulated around {result['simulate_acceptance']} "
        f"({result.get('acceptance_curve', 'poisson')}; bench only), {result['steps']} timed steps per "
        f"case, mode and round; {result.get('rounds', 1)} rounds from graphs, eager once",
        "- plain: an engine without a drafter; DFlash: the engine with the drafter. Each case is timed "
        "from CUDA graphs and eagerly, side by side on the same engine and sequences; "
        + ("with async scheduling (the next step queued before this one is read)."
           if result.get("async_scheduling", True) else "without async scheduling (each step read "
           "before the next is queued)."),
        "",
        "ms per step: median (p10-p90); tok/s: emitted tokens over the timed steps; prefill: the B prompts' "
        "(B x C tokens, several steps when over the token budget); kernels: GPU kernels "
        "one step runs (torch profiler; from graphs they are replayed by one launch per graph, not "
        "launched one by one).",
        "",
        "| B | context | plain ms, graphs | plain ms, eager | plain tok/s graphs / eager | DFlash ms, graphs "
        "| DFlash ms, eager | DFlash tok/s graphs / eager | acceptance "
        "| kernels DFlash graphs / eager | prefill s plain / DFlash | HF decode ms | HF verify K+1 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in result["dflash"]:
        key = (case["batch"], case["context"])
        base, ref = plain.get(key), hf.get(key)
        lines.append(
            f"| {key[0]} | {key[1]} | {_ms((base or {}).get('graphs'))} | {_ms((base or {}).get('eager'))} | "
            f"{_cell(base, 'graphs', 'tokens_per_s')} / {_cell(base, 'eager', 'tokens_per_s')} | "
            f"{_ms(case.get('graphs'))} | {_ms(case.get('eager'))} | "
            f"{_cell(case, 'graphs', 'tokens_per_s')} / {_cell(case, 'eager', 'tokens_per_s')} | "
            f"{_cell(case, 'graphs' if 'graphs' in case else 'eager', 'mean_acceptance_length', '{:.2f}')} | "
            f"{_cell(case, 'graphs', 'kernel_launches')} / {_cell(case, 'eager', 'kernel_launches')} | "
            f"{(base or {}).get('prefill_s', '-')} / {case.get('prefill_s', '-')} | "
            f"{_ms(ref['decode']) if ref else '-'} | {_ms(ref['verify']) if ref else '-'} |"
        )
    busy = [
        f"B {c['batch']} ctx {c['context']}: {_cell(c, 'graphs', 'gpu_busy_ms', '{:.1f}')} ms"
        for c in result["dflash"]
    ]
    lines += ["", "GPU busy time of one DFlash step from graphs: " + "; ".join(busy) + "."]
    lines += ["", "Each round's median from graphs, ms:", ""]
    lines += [_rounds_line(mode, case) for mode in ("plain", "dflash") for case in result[mode]
              if "round_medians" in case.get("graphs", {})]
    lines += _token_mode_lines(result)
    lines += _limits_lines(result.get("limits", []))
    if result["skipped"]:
        lines += [
            "",
            "Not run: "
            + ", ".join(
                f"{s['mode']} B {s['batch']} ctx {s['context']} ({s['why']})" for s in result["skipped"]
            ),
        ]
    lines += [
        "",
        "Goals (issue): plain decode <= 6 ms at B 1 and <= 14 ms at B 32; a DFlash step <= 6.5 ms "
        "at B 1 and <= 20 ms at B 32.",
        "",
    ]
    return "\n".join(lines)


def _token_mode_lines(result: dict) -> list[str]:
    """The token proposers' steps (`dflash_cli.bench.proposer_modes`) beside ngram's and DFlash's, from
    graphs (eagerly where none were captured)."""
    modes = [mode for mode in TOKEN_MODES if result.get(mode)]
    if not modes:
        return []
    by_mode = {mode: {(c["batch"], c["context"]): c for c in result.get(mode, [])}
               for mode in ("dflash", *TOKEN_MODES)}

    def timing(case: dict | None) -> dict:
        case = case or {}
        return case.get("graphs") or case.get("eager") or {}

    def ratio(case: dict, mode: str) -> str:
        mine = timing(case).get("tokens_per_s")
        theirs = timing(by_mode[mode].get((case["batch"], case["context"]))).get("tokens_per_s")
        return f"{mine / theirs:.3f}" if mine and theirs else "-"

    lines = ["", "Token proposers (K as DFlash's unless asked; hybrid-lookup: the hybrid pinned to the "
             "lookup, its context kept whole), from graphs, eagerly where none were captured:", "",
             "| mode | B | context | ms per step | tok/s | acceptance | tok/s over ngram's | over DFlash's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode in modes:
        for case in result[mode]:
            timed = timing(case)
            lines.append(f"| {mode} | {case['batch']} | {case['context']} | {_ms(timed)} | "
                         f"{timed.get('tokens_per_s', 0):.0f} | "
                         f"{timed.get('mean_acceptance_length', 0):.2f} | "
                         f"{ratio(case, 'ngram')} | {ratio(case, 'dflash')} |")
    return lines


def _limits_lines(rows: list[dict]) -> list[str]:
    """The limits sweep's table (`step_limits`): one DFlash step per engine config and batch."""
    if not rows:
        return []
    lines = ["", "Step time against the engine's limits (DFlash; ms per step, median (p10-p90); startup: "
             "weights, pool and graph capture):", "",
             "| max_num_seqs | kv_cache_memory | pool blocks | startup s | B | context | graphs ms "
             "| eager ms | GPU busy ms, graphs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['max_num_seqs']} | {row['kv_cache_memory']} | - | - | - | - | "
                         f"not started: {row['error']} | - | - |")
            continue
        lines.append(f"| {row['max_num_seqs']} | {row['kv_cache_memory']} | {row['pool_blocks']} | "
                     f"{row['startup_s']} | {row['batch']} | {row['context']} | {_ms(row.get('graphs'))} | "
                     f"{_ms(row.get('eager'))} | "
                     f"{_cell(row, 'graphs', 'gpu_busy_ms', '{:.1f}')} |")
    return lines


def _rounds_line(mode: str, case: dict) -> str:
    rounds = " ".join(f"{t * 1e3:.2f}" for t in case["graphs"]["round_medians"])
    return f"- {mode} B {case['batch']} ctx {case['context']}: {rounds}"


def plot(result: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    contexts = sorted({case["context"] for case in result["dflash"]}) or [0]
    figure, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    hf = {(row["batch"], row["context"]): row for row in result["hf"]}
    for axis, context in zip(axes[0], contexts):
        for mode, color in (("plain", "tab:blue"), ("dflash", "tab:orange")):
            cases = [c for c in result[mode] if c["context"] == context]
            for label, style in (("graphs", "-"), ("eager", ":")):
                points = [(c["batch"], c[label]["tokens_per_s"]) for c in cases if label in c]
                if points:
                    axis.plot(
                        *zip(*points), marker="o", linestyle=style, color=color, label=f"{mode} {label}"
                    )
        refs = [
            (b, hf[(b, context)])
            for b in sorted({c["batch"] for c in result["dflash"]})
            if (b, context) in hf
        ]
        if refs:
            axis.plot(
                [b for b, _ in refs],
                [b / r["decode"]["median"] for b, r in refs],
                marker="s",
                linestyle="--",
                color="tab:green",
                label="HF eager plain",
            )
        for name, goals in GOALS_MS.items():
            acceptance = result["simulate_acceptance"] if name == "dflash" else 1.0
            axis.scatter(
                list(goals),
                [b * acceptance / (ms / 1e3) for b, ms in goals.items()],
                marker="*",
                s=90,
                color="tab:orange" if name == "dflash" else "tab:blue",
                label=f"goal {name}",
            )
        axis.set(
            xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s", title=f"context {context}"
        )
        axis.legend(fontsize=7)
    figure.suptitle(f"{result['device']}, {result['geometry']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
