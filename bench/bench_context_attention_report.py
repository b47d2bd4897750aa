"""The report of bench/bench_context_attention.py: the markdown tables and the PNG."""

from __future__ import annotations

from pathlib import Path

from dflash_cli.bench.plotting import pyplot


def fmt(value, spec=".1f"):
    return "n/a" if value is None else format(value, spec)


def markdown(result, geometry: dict) -> str:
    """`geometry`: the bench's num_q, group, head_dim and tokens per block (tpb)."""
    env, copy_gbps = result["env"], result["copy_bw"] / 1e9
    lines = [
        "# paged_context_attention on " + env["device"],
        "",
        f"Commit {env['commit']}, {env['date']}, torch {env['torch']}, triton {env['triton']}. "
        f"Command: `{env['command']}`.",
        f"Copy bandwidth measured in this run (read + write): **{copy_gbps:.0f} GB/s**. "
        f"D {geometry['head_dim']}, Q {geometry['num_q']}, group {geometry['group']}, "
        f"{geometry['tpb']}-token pages scattered in a pool arena; "
        "times in us per call under CUDA graphs (median of replays, inputs rotated past L2). "
        "SDPA runs over a dense bf16 buffer also for fp8 rows (no fp8 SDPA).",
        "",
        "| dtype | NKV | B | ctx | grid splits | ours us | GB/s | % copy | single pass us | SDPA dense us "
        "| floor us | SDPA / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["sweep"]:
        if "skipped" in r:
            lines.append(f"| {r['dtype']} | {r['nkv']} | {r['batch']} | {r['ctx']} | "
                         f"skipped ({r['skipped']}) | | | | | | | |")
            continue
        ratio = None if r["sdpa_us"] is None else r["sdpa_us"] / r["ours_us"]
        lines.append(
            f"| {r['dtype']} | {r['nkv']} | {r['batch']} | {r['ctx']} | {r['grid_splits']} | "
            f"{fmt(r['ours_us'])} | {fmt(r['ours_gbps'], '.0f')} | {fmt(r['ours_pct_copy'], '.0f')} | "
            f"{fmt(r['single_pass_us'])} | {fmt(r['sdpa_us'])} | {fmt(r['floor_us'])} | "
            f"{fmt(ratio, '.2f')} |")
    lines += ["", "## Graph safety (captured once, replayed at other lengths, vs the torch reference)", "",
              "| B | dtype | lens (first 4) | rel err | NaN |", "|---|---|---|---|---|"]
    lines += [f"| {g['batch']} | {g['dtype']} | {g['lens_head']} | {g['rel_err']:.2e} | {g['nan']} |"
              for g in result["graph_safety"]]
    lines += ["", f"Compiled variants after batch sizes 1, 2, 3, 5, 8, 13, 24: {result['recompile_counts']} "
              "(constant = no recompiles).", "",
              f"Ours vs SDPA over the same context gathered densely (B 2, ctx 2048): rel err "
              f"{result['sdpa_rel_err']:.2e}.", "",
              "## Tile sweep (ctx 8192, NKV 4; the first row of each path is the default)", "",
              "| B | dtype | path | block_n / warps / stages / merge chunk | us | GB/s |",
              "|---|---|---|---|---|---|"]
    for t in result["tune"]:
        cfg = t.get("config")
        cfg_text = ("default" if cfg is None else f"{cfg['block_n']} / {cfg['num_warps']} / "
                    f"{cfg['num_stages']} / chunk {cfg['merge_chunk']}")
        lines.append(f"| {t['batch']} | {t['dtype']} | {t['path']} | {cfg_text} | {t['us']:.1f} | "
                     f"{t['gbps']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(result, path: Path, geometry: dict) -> None:
    """Time per call against B, a panel per (cache dtype, NKV) of the sweep, a line colour per context."""
    plt = pyplot(path)
    if plt is None:
        return

    measured = [r for r in result["sweep"] if "skipped" not in r]
    contexts = sorted({r["ctx"] for r in result["sweep"]})
    dtypes = list(dict.fromkeys(r["dtype"] for r in result["sweep"]))
    kv_heads = sorted({r["nkv"] for r in result["sweep"]})
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), sharex=True)
    colors = dict(zip(contexts, ("tab:blue", "tab:orange", "tab:green")))
    for ax, (dtype_name, nkv) in zip(axes.flat, [(d, n) for d in dtypes for n in kv_heads]):
        for ctx in contexts:
            rows = [r for r in measured if r["dtype"] == dtype_name and r["nkv"] == nkv and r["ctx"] == ctx]
            if not rows:
                continue
            batches = [r["batch"] for r in rows]
            ax.plot(batches, [r["ours_us"] for r in rows], "o-", color=colors[ctx], label=f"ours ctx {ctx}")
            ax.plot(batches, [r["sdpa_us"] or float("nan") for r in rows], "s--", color=colors[ctx],
                    alpha=0.6, label=f"SDPA dense ctx {ctx}")
            ax.plot(batches, [r["floor_us"] for r in rows], ":", color=colors[ctx], alpha=0.8,
                    label=f"bytes floor ctx {ctx}")
        ax.set(xscale="log", yscale="log", title=f"{dtype_name} context, NKV {nkv}", xlabel="batch B",
               ylabel="us per call (CUDA graph)")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"paged_context_attention, D {geometry['head_dim']}, Q {geometry['num_q']}, group "
                 f"{geometry['group']}, on {result['env']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
