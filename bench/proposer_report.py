"""What a `bench.bench_proposers` record says: the issue's goal checks, computed whether they pass or
not, and the markdown report (goal table, one table per class and batch, the raw record at the end).
"""

from __future__ import annotations

import json
import statistics

METHODS = ("dflash", "ngram", "hybrid")  # the proposers compared; "plain" is timed beside them
MODES = ("batch1", "batch")


def goal_checks(record: dict) -> dict:
    """Per class and mode: hybrid acceptance over the per-prompt better of DFlash and ngram (mean over
    prompts, goal >= 0.95); hybrid tok/s over the better method's on the class (goal >= 0.97); and on the
    prompts where one proposer's acceptance is >= 1.5x the other's, hybrid's over the winner's (goal >=
    0.90 on each)."""
    goals = {}
    for name, cls in record["classes"].items():
        for mode in MODES:
            rows = cls[mode]
            dflash, ngram, hybrid = (rows[m]["acceptance"] for m in METHODS)
            better = [max(d, n) for d, n in zip(dflash, ngram)]
            speeds = {m: rows[m]["tokens_per_s"]["median"] for m in METHODS}
            best = max(("dflash", "ngram"), key=speeds.get)
            decisive = [(i, h / max(d, n)) for i, (d, n, h) in enumerate(zip(dflash, ngram, hybrid))
                        if max(d, n) >= 1.5 * min(d, n)]
            acceptance = statistics.mean(hybrid) / statistics.mean(better)
            speed = speeds["hybrid"] / speeds[best]
            goals[f"{name}/{mode}"] = {
                "acceptance_ratio": acceptance, "acceptance_pass": acceptance >= 0.95,
                "best_method": best, "speed_ratio": speed, "speed_pass": speed >= 0.97,
                "decisive_prompts": [i for i, _ in decisive], "decisive_fractions": [f for _, f in decisive],
                "decisive_pass": all(f >= 0.90 for _, f in decisive)}
    return goals


# ---- report -------------------------------------------------------------------------------------

def _rate(spread: dict) -> str:
    return f"{spread['median']:.0f} ({spread['min']:.0f}-{spread['max']:.0f})"


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def _class_table(name: str, cls: dict, mode: str) -> list[str]:
    rows = cls[mode]
    hybrid = rows["hybrid"]
    title = "each prompt alone" if mode == "batch1" else f"one batch of {cls['batch_size']}"
    lines = [f"### {name}, {title}", "",
             "| prompt (tokens) | acceptance dflash / ngram / hybrid | tok/s dflash / ngram / hybrid "
             "| hybrid's ngram share |", "| --- | --- | --- | --- |"]
    for i, length in enumerate(cls["prompt_lens"]):
        acc = " / ".join(f"{rows[m]['acceptance'][i]:.2f}" for m in METHODS)
        speed = (" / ".join(f"{rows[m]['prompt_tokens_per_s'][i]:.0f}" for m in METHODS)
                 if mode == "batch1" else "-")
        lines.append(f"| {i} ({length}) | {acc} | {speed} | {hybrid['ngram_share_per_prompt'][i]:.2f} |")
    mean = " / ".join(f"{statistics.mean(rows[m]['acceptance']):.2f}" for m in METHODS)
    speed = " / ".join(_rate(rows[m]["tokens_per_s"]) for m in METHODS)
    lines += [f"| **class** | {mean} | {speed} | {hybrid['ngram_share']:.2f} |", "",
              f"Plain decoding {rows['plain']['tokens_per_s']['median']:.0f} tok/s (one round). "
              "Identical to plain greedy: "
              + ", ".join(f"{m} {rows[m]['lossless']}/{rows[m]['outputs']}" for m in METHODS)
              + f". Choosing: {hybrid['choose_us_per_step']:.0f} us per step beside the DFlash drafter's "
              f"{hybrid['dflash_us_per_step']:.0f} us ({hybrid['steps_timed']} metered steps)"
              + _choosing_parts(hybrid) + ".", ""]
    return lines


def _choosing_parts(hybrid: dict) -> str:
    """Where the hybrid's host time per step goes beyond the drafter's (records before the split lack it)."""
    if "deciding_us_per_step" not in hybrid:
        return ""
    staging = hybrid.get("staging_us_per_step")  # records before it counted it as deciding
    held = "" if staging is None else f", the held rows staged before a drafter run {staging:.0f} us"
    return (f": deciding {hybrid['deciding_us_per_step']:.0f} us{held}, the lookup's proposal and its write "
            f"{hybrid['lookup_us_per_step']:.0f} us (ngram's work too); the runner's context rows, held or "
            f"stored, {hybrid['context_us_per_step']:.0f} us beside the drafter's stores from there "
            f"{hybrid['context_dflash_us_per_step']:.0f} us")


def report(record: dict) -> str:
    lines = ["# Proposers: DFlash, ngram and hybrid on the demo pair", "",
             f"- command: `{record['command']}`", f"- device: {record['device']}",
             f"- commit {record['commit']}, {record['date']}; torch {record['torch']}, "
             f"{record['threads']} threads, {record['dtype']}; the run took {record['wall_s']:.0f} s "
             "of wall time",
             f"- greedy, ignore_eos, K {record['num_speculative_tokens']}, {record['max_tokens']} new "
             f"tokens; tok/s of {record['clock']} (median over {record['rounds']} rounds after a warm-up, "
             "min-max); the class line's tok/s is all its tokens over all its seconds; acceptance = "
             "1 + accepted / drafts from the warm-up round's RequestOutputs", "",
             "## Goal checks", "",
             "| class / batch | hybrid acceptance / per-prompt better (>= 0.95) "
             "| hybrid tok/s / best method's (>= 0.97) "
             "| decisive prompts: hybrid / winner's acceptance (>= 0.90 each) |",
             "| --- | --- | --- | --- |"]
    for key, goal in record["goals"].items():
        fractions = ", ".join(f"{f:.2f}" for f in goal["decisive_fractions"]) or "none"
        lines.append(f"| {key} | {goal['acceptance_ratio']:.3f} {_verdict(goal['acceptance_pass'])} "
                     f"| {goal['speed_ratio']:.3f} vs {goal['best_method']} {_verdict(goal['speed_pass'])} "
                     f"| {fractions} {_verdict(goal['decisive_pass'])} |")
    lines += ["", "## Per class", ""]
    for name, cls in record["classes"].items():
        for mode in MODES:
            lines += _class_table(name, cls, mode)
    lines += ["## Raw record", "", "```json", json.dumps(record, indent=1), "```", ""]
    return "\n".join(lines)
