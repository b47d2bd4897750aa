"""What `bench.bench_serve_modes` measured, as markdown and a PNG (split out so the bench reads as the
method; `--replot JSON` redraws both from a run's JSON where the run's machine had no matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_cli.bench.plotting import pyplot

MODE_ORDER = ("plain", "dense", "paged")
COLORS = {"plain": "tab:gray", "dense": "tab:orange", "paged": "tab:blue"}


def _size(value: int) -> str:
    from foundation.byte_size import format_bytes

    return format_bytes(value) if value else "0"


def _ms(summary: dict | None, key: str) -> str:
    return "-" if summary is None else f"{summary[key] * 1e3:.1f}"


def ordered_modes(doc: dict) -> list[dict]:
    modes = doc.get("serve", {}).get("modes", [])
    return sorted(modes, key=lambda m: MODE_ORDER.index(m["mode"]) if m["mode"] in MODE_ORDER else 99)


def serve_lines(doc: dict) -> list[str]:
    serve = doc["serve"]
    modes = ordered_modes(doc)
    lines = ["## Serving by concurrency", "",
             f"Random-token prompts of {serve['input_len']} tokens, {serve['output_len']} output tokens "
             "each (greedy, ignore_eos), streamed; per level max(min_prompts, prompts_per_level x C) = "
             f"max({serve['min_prompts']}, {serve['prompts_per_level']} x C) requests, fresh prompts per "
             "level (no prefix-cache hits), the same prompts in every mode. Before the levels, "
             f"{serve['warmup_requests']} warm-up requests of {serve['warmup_tokens']} tokens"
             f"{', and C more before each level' if serve.get('warmup_per_level') else ''} (not "
             f"counted). Serving engines: max_num_seqs {serve['max_num_seqs']}, max_model_len "
             f"{serve['max_model_len']}, kv_cache_memory {serve['kv_cache_memory'] or 'the engine default'}.",
             "",
             "| C | mode | done | output tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| ITL p50 ms | acceptance length | drafts |",
             "| --- " * 10 + "|"]
    levels = sorted({s["value"] for m in modes for s in m.get("settings", [])})
    for level in levels:
        for mode in modes:
            for s in (s for s in mode.get("settings", []) if s["value"] == level):
                accepted = s["acceptance"] or {}
                length = accepted.get("mean_acceptance_length")
                lines.append(
                    f"| {level:g} | {mode['mode']} | {s['completed']}/{s['requests']} | "
                    f"{s['output_throughput']:.1f} | {s['request_throughput']:.2f} | "
                    f"{_ms(s['ttft_s'], 'p50')} / {_ms(s['ttft_s'], 'p99')} | "
                    f"{_ms(s['tpot_s'], 'p50')} / {_ms(s['tpot_s'], 'p99')} | {_ms(s['itl_s'], 'p50')} | "
                    f"{'-' if length is None else f'{length:.2f}'} | {accepted.get('drafts', 0):.0f} |")
    lines += ["", "| mode | drafter | context | K | startup s | pool blocks | tokens/block "
              "| dense reservation | preemptions | levels skipped | GPU memory after release | error |",
              "| --- " * 12 + "|"]
    for m in modes:
        lines.append(
            f"| {m['mode']} | {'yes' if m['drafter'] else 'no'} "
            f"| {m['context_storage'] if m['drafter'] else '-'} | {m.get('num_speculative_tokens', '-')} "
            f"| {m.get('startup_s', 0):.1f} | {m.get('pool_blocks', '-')} "
            f"| {m.get('tokens_per_block', '-')} | {_size(m.get('dense_context_bytes', 0))} "
            f"| {m.get('preemptions', '-')} | {m.get('skipped_levels') or '-'} "
            f"| {_size(m.get('memory_allocated_after', 0))} | {m.get('error') or '-'} |")
    return lines


def admission_lines(doc: dict) -> list[str]:
    adm = doc["admission"]
    lines = ["## Requests admitted at equal memory, paged vs dense", "",
             f"KV budget {_size(adm['memory_bytes'])} for both; {adm['num_requests']} requests of "
             f"{adm['prompt_len']} prompt tokens, max_tokens {adm['max_tokens']}, all submitted at once "
             "to the engine (eager, prefix caching off), stepped until the first finished. Dense runs at "
             "its best max_num_seqs (the smallest at which the plan runs the most requests of prompt + "
             f"max_tokens), paged at {adm['max_num_seqs']}.", "",
             "| max_model_len | storage | max_num_seqs | pool blocks | dense reservation | plan: requests "
             "| engine: peak running | running at first finish | peak blocks used | peak memory held "
             "| preemptions | steps |", "| --- " * 12 + "|"]
    plans = {(p["storage"], p["max_model_len"], p["max_num_seqs"]): p for p in adm["plans"]}
    lengths = sorted({p["max_model_len"] for p in adm["plans"]}, reverse=True)
    paged = next((c for c in adm["cases"] if c["storage"] == "paged"), None)
    for length in lengths:
        rows = [c for c in adm["cases"] if c["storage"] == "dense" and c["max_model_len"] == length]
        for case in ([paged] if paged else []) + rows:
            planned = plans.get((case["storage"], length, case["max_num_seqs"]))
            first = case["first_finish"] or {}
            lines.append(
                f"| {length} | {case['storage']} | {case['max_num_seqs']} | {case['pool_blocks']} | "
                f"{_size(case['dense_context_bytes'])} | "
                f"{planned['concurrent_requests'] if planned else '-'} | "
                f"{case['peak_running']} | {first.get('running', '-')} | {case['peak_used_blocks']} | "
                f"{_size(case['peak_held_bytes'])} | {case['preemptions']} | {case['steps']} |")
        dense_cap = plans.get(("dense", length, adm["max_num_seqs"]))
        if dense_cap is not None:
            lines.append(f"| {length} | dense | {adm['max_num_seqs']} | {dense_cap['num_blocks']} | "
                         f"{_size(dense_cap['draft_context_bytes'])} | {dense_cap['concurrent_requests']} | "
                         "not run (the plan's row) | | | | | |")
    if paged is not None:
        lines += ["", "Paged's pool does not depend on max_model_len: it ran once, at "
                  f"{paged['max_model_len']}, and its row is repeated."]
    for skipped in adm["skipped"]:
        lines.append(f"- not run: {skipped['storage']} at max_model_len {skipped['max_model_len']} "
                     f"({skipped['why']})")
    for length, text in adm["plan_text"].items():
        lines += ["", f"`dflash plan` at max_model_len {length}, max_num_seqs {adm['max_num_seqs']}, "
                  f"avg-seq-len {adm['prompt_len'] + adm['max_tokens']}:", "", "```", text, "```"]
    return lines


def markdown(doc: dict) -> str:
    pair = doc["checkpoints"]
    lines = [f"# Serving modes: {doc['name']}", "",
             f"- date {doc['date']}, commit {doc['commit']}, device {doc['device']}, torch {doc['torch']}",
             f"- host: {doc['host']}",
             f"- command: `{doc['command']}`",
             f"- checkpoints: {pair['target']} + {pair['drafter']} ({pair['origin']})",
             f"- wall time {doc.get('elapsed_s', 0):.0f} s" +
             (f" of a {doc['budget_s']:g} s budget" if doc.get("budget_s") is not None else ""), ""]
    if pair.get("random_weights"):
        lines += ["Random weights: the drafter's guesses are almost never accepted (acceptance length ~1), "
                  "so dense and paged against plain here measure what drafting costs, not the speed-up a "
                  "trained drafter gives; the acceptance column is the server's own /metrics counters over "
                  "each level. `dflash bench step` times the step at a simulated acceptance.", ""]
    if "serve" in doc:
        lines += ["Served by `dflash serve`'s HTTP app (`target_service.serving.api.create_app` over a "
                  "`Replica`, the object each Ray Serve replica builds), under "
                  f"uvicorn ({doc['serve']['transport']}) on 127.0.0.1 in the benchmark's process: the same "
                  "app and engine without Ray Serve's proxy hop (no Ray Serve on the machine). The load "
                  "generator (`dflash_cli.bench.serve_load`'s functions) ran in a child process.", "",
                  *serve_lines(doc), ""]
    if "admission" in doc:
        lines += [*admission_lines(doc), ""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> bool:
    """Output tok/s and TTFT p50 against concurrency per mode, and the admission peaks; False (and no
    file, one log line) without matplotlib."""
    plt = pyplot(path)
    if plt is None:
        return False

    panels = 2 + ("admission" in doc and bool(doc["admission"]["cases"]))
    figure, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4))
    for mode in ordered_modes(doc):
        settings = sorted(mode.get("settings", []), key=lambda s: s["value"])
        if not settings:
            continue
        x = [s["value"] for s in settings]
        style = {"marker": "o", "color": COLORS.get(mode["mode"]), "label": mode["mode"]}
        axes[0].plot(x, [s["output_throughput"] for s in settings], **style)
        ttft = [(s["value"], s["ttft_s"]["p50"] * 1e3) for s in settings if s["ttft_s"]]
        axes[1].plot([v for v, _ in ttft], [t for _, t in ttft], **style)
    levels = sorted({s["value"] for m in ordered_modes(doc) for s in m.get("settings", [])})
    axes[0].set(ylabel="output tokens/s", title="throughput")
    axes[1].set(yscale="log", ylabel="TTFT p50, ms", title="time to first token")
    for axis in axes[:2]:
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [f"{level:g}" for level in levels])
        axis.set_xlabel("concurrency (requests in flight)")
        if axis.lines:
            axis.legend(fontsize=8)
    if panels == 3:
        _admission_bars(doc["admission"], axes[2])
    figure.suptitle(f"{doc['name']}: {doc['device']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _admission_bars(adm: dict, axis) -> None:
    paged = next((c for c in adm["cases"] if c["storage"] == "paged"), None)
    lengths = sorted({c["max_model_len"] for c in adm["cases"] if c["storage"] == "dense"} |
                     ({paged["max_model_len"]} if paged else set()))
    for index, length in enumerate(lengths):
        dense = next((c for c in adm["cases"]
                      if c["storage"] == "dense" and c["max_model_len"] == length), None)
        for offset, case, name in ((-0.2, paged, "paged"), (0.2, dense, "dense")):
            if case is None:
                continue
            first = (case["first_finish"] or {}).get("running", case["peak_running"])
            axis.bar(index + offset, first, width=0.38, color=COLORS[name],
                     label=name if index == 0 else None)
            axis.annotate(f"{first} (peak {case['peak_running']})", (index + offset, first), ha="center",
                          xytext=(0, 3), textcoords="offset points", fontsize=7)
    axis.margins(y=0.15)
    axis.set_xticks(range(len(lengths)), [f"max_model_len {n}" for n in lengths])
    axis.set(ylabel="running requests at first finish", title=f"admitted at {_size(adm['memory_bytes'])}")
    axis.legend(fontsize=8)


def write(doc: dict, out: Path, *, plot_too: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{doc['name']}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / f"{doc['name']}.md").write_text(markdown(doc))
    if plot_too:
        plot(doc, out / f"{doc['name']}.png")  # without matplotlib: redraw later with --replot JSON


def replot(path: Path) -> None:
    """The markdown and PNG again, from a run's JSON, beside it."""
    write(json.loads(path.read_text()), path.parent, plot_too=True)
