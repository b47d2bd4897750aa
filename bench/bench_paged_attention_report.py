"""The report of bench/bench_paged_attention.py: floors and percentages, the markdown table, the PNG."""

from __future__ import annotations

from dflash_cli.bench.plotting import pyplot

DTYPES = ("bf16", "fp8")


def annotate(result) -> None:
    """Floors and percentages from the ceilings measured in the same run."""
    bw, mm = result["ceilings"]["copy_bytes_per_s"], result["ceilings"]["matmul_flop_per_s"]
    for case in result["cases"]:
        case["bytes_floor_s"] = case["bytes"] / bw
        case["flops_floor_s"] = case["flops"] / mm
        case["pct_copy_bw"] = 100 * case["bytes_floor_s"] / case["seconds"]
        case["pct_matmul"] = 100 * case["flops_floor_s"] / case["seconds"]
        sdpa = case.get("sdpa_seconds")
        case["speedup_vs_sdpa"] = sdpa / case["seconds"] if sdpa else None


def markdown(result) -> str:
    meta, ceil, lines = result["meta"], result["ceilings"], []
    lines += [f"# paged_attention on {meta['device']}", "",
              f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}",
              f"command: `{meta['command']}`", "",
              f"Ceilings measured in this run: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s "
              f"(read + write), bf16 matmul {ceil['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s; each the higher "
              f"of a measurement before and after the cases. Copies in TB/s, before: "
              f"{ceil['first'].get('copy_tb_per_s')}, after: {ceil['last'].get('copy_tb_per_s')}.", ""]
    lines += [*summary(result), ""]
    lines += ["| cache | q_len | B | ctx | kernel us | SDPA dense us | bytes floor us | % copy BW | "
              "x SDPA | tiles (m, n, warps, stages) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        if c.get("kind") == "prefill":
            continue
        t = c["tiles"]
        sdpa = f"{c['sdpa_seconds'] * 1e6:.1f}" if c["sdpa_seconds"] else "-"
        speed = f"{c['speedup_vs_sdpa']:.2f}" if c["speedup_vs_sdpa"] else "-"
        lines.append(f"| {c['dtype']} | {c['q_len']} | {c['batch']} | {c['ctx']} | "
                     f"{c['seconds'] * 1e6:.1f} | {sdpa} | {c['bytes_floor_s'] * 1e6:.1f} | "
                     f"{c['pct_copy_bw']:.0f} | {speed} | "
                     f"{t['block_m']}, {t['block_n']}, {t['num_warps']}, {t['num_stages']} |")
    lines += ["", "| prefill | tokens | kernel ms | SDPA dense ms | FLOPs floor ms | TFLOP/s | % matmul "
              "| x SDPA |", "|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        if c.get("kind") == "prefill":
            sdpa = f"{c['sdpa_seconds'] * 1e3:.3f}" if c["sdpa_seconds"] else "-"
            lines.append(f"| {c['dtype']} | {c['q_len']} | {c['seconds'] * 1e3:.3f} | {sdpa} | "
                         f"{c['flops_floor_s'] * 1e3:.3f} | {c['flops'] / c['seconds'] / 1e12:.0f} | "
                         f"{c['pct_matmul']:.0f} | {c['speedup_vs_sdpa'] or 0:.2f} |")
    lines += ["", "Tile sweep (B 32 ctx 8192 for decode/verify; tiles as block_q, block_m, block_n, "
              "warps, stages; the best per regime and cache dtype is used above):", ""]
    if not result["sweep"]["rows"]:
        lines[-2] = ("No tile sweep in this run (--no-sweep): the tiles are choose_tiles' GPU defaults "
                     "(kernels.paged_tiles.GPU_TILES), the winners of an earlier run's sweep (a run "
                     "without --no-sweep).")
    for r in result["sweep"]["rows"]:
        timed = f"{r['seconds'] * 1e6:.1f} us" if "seconds" in r else f"failed ({r['error'][:80]})"
        lines.append(f"- {r['dtype']} {r['regime']} {tuple(r['tiles'].values())}: {timed}")
    lines += ["", "Split-KV: planned (None) against forced split counts, bf16:", "",
              "| B | ctx | q_len | num_splits | us |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['ctx']} | {r['q_len']} | {r['num_splits']} | {r['seconds'] * 1e6:.1f} |"
              for r in result["sweep"].get("splits", [])]
    return "\n".join(lines) + "\n"


def summary(result) -> list[str]:
    lines = []
    small = [c for c in result["cases"] if c.get("kind") != "prefill"]
    for dtype in DTYPES:
        for label, q_lens in (("decode", (1,)), ("verify", (8, 16))):
            pcts = [c["pct_copy_bw"] for c in small if c["dtype"] == dtype and c["batch"] >= 32
                    and c["q_len"] in q_lens]
            if pcts:
                lines.append(f"- {dtype} {label}, B >= 32: {min(pcts):.0f}% .. {max(pcts):.0f}% of copy "
                             f"bandwidth (target >= 80%)")
    for c in result["cases"]:
        if c.get("kind") == "prefill":
            lines.append(f"- {c['dtype']} prefill {c['q_len']} tokens: {c['pct_matmul']:.0f}% of bf16 matmul "
                         f"throughput (target >= 50%)")
    errs = [c["rel_err_vs_sdpa"] for c in result["cases"] if "rel_err_vs_sdpa" in c]
    if errs:
        lines.append(f"- output vs SDPA over dense: max relative L2 error {max(errs):.1e} over {len(errs)} "
                     "cases")
    slower = [c for c in result["cases"] if c["speedup_vs_sdpa"] and c["speedup_vs_sdpa"] < 1]
    lines.append(f"- slower than SDPA over dense in {len(slower)} of "
                 f"{sum(1 for c in result['cases'] if c['speedup_vs_sdpa'])} cases" + (": " + ", ".join(
                     f"{c['dtype']} q{c['q_len']} B{c['batch']} ctx{c['ctx']} ({c['speedup_vs_sdpa']:.2f}x)"
                     for c in slower) if slower else ""))
    return lines


def plot(result, path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    small = [c for c in result["cases"] if c.get("kind") != "prefill"]
    q_lens = sorted({c["q_len"] for c in small})
    fig, axes = plt.subplots(1, len(q_lens) + 1, figsize=(5 * (len(q_lens) + 1), 4.2))
    for ax, q_len in zip(axes, q_lens):
        for i, ctx in enumerate(sorted({c["ctx"] for c in small})):
            for dtype, style in (("bf16", "-"), ("fp8", "--")):
                rows = sorted((c for c in small if (c["q_len"], c["ctx"], c["dtype"]) == (q_len, ctx, dtype)),
                              key=lambda c: c["batch"])
                ax.plot([c["batch"] for c in rows], [c["pct_copy_bw"] for c in rows], style, color=f"C{i}",
                        marker="o", label=f"{dtype} ctx {ctx}")
                if dtype == "bf16":  # SDPA reads bf16 dense: its own % of the same bf16 floor
                    ax.plot([c["batch"] for c in rows if c["sdpa_seconds"]],
                            [100 * c["bytes_floor_s"] / c["sdpa_seconds"] for c in rows if c["sdpa_seconds"]],
                            ":", color=f"C{i}", marker="x", label=f"SDPA dense ctx {ctx}")
        ax.axhline(80, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="batch", ylabel="% of copy bandwidth", title=f"q_len {q_len}",
               ylim=(0, 110))
    axes[0].legend(fontsize=6)
    prefill = [c for c in result["cases"] if c.get("kind") == "prefill"]
    labels = [f"{c['dtype']}" for c in prefill] + ["SDPA dense"]
    values = [c["flops"] / c["seconds"] / 1e12 for c in prefill]
    sdpa_s = prefill[0]["sdpa_seconds"]
    values.append(prefill[0]["flops"] / sdpa_s / 1e12 if sdpa_s else 0)
    axes[-1].bar(labels, values, color=["C0", "C1", "C7"])
    axes[-1].axhline(result["ceilings"]["matmul_flop_per_s"] / 1e12, color="gray", lw=0.8,
                     label="bf16 matmul")
    axes[-1].set(ylabel="TFLOP/s", title=f"prefill {prefill[0]['q_len']} tokens")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"paged_attention, {result['meta']['device']}, commit {result['meta']['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
